"""Benchmark KeyIndex: memory per block and batched lookup latency.

    python benchmarks/index_bench.py [--blocks N] [--json OUT]

Builds an index of N random 128-bit fingerprints (as a store of N random hex
page hashes would hold), reports bytes per block (index.nbytes / N and the
VmRSS delta of building it), then times ``lookup`` of 128 64-char hex keys
drawn from the inserted set.  Prints the configuration, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sglang_flatcake.index import KeyIndex  # noqa: E402

BATCH = 128


def vm_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def hex_keys(digests: np.ndarray, rng: np.random.Generator) -> list[str]:
    """64-char hex keys whose fingerprint is each row of ``digests``."""
    tails = rng.integers(0, 2**63, size=(len(digests), 2), dtype=np.uint64)
    full = np.concatenate([digests, tails], axis=1).astype("<u8")
    return [row.tobytes().hex() for row in full]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=10_000_000)
    p.add_argument("--batches", type=int, default=5000, help="timed lookup batches (>= 2000)")
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", default=None)
    args = p.parse_args(argv)
    n = args.blocks
    rng = np.random.default_rng(args.seed)

    # JIT / cache load outside the measured region.
    warm = KeyIndex(16)
    warm.put_many(hex_keys(rng.integers(0, 2**63, size=(4, 2), dtype=np.uint64), rng), range(4))
    warm.lookup(["0" * 64])

    digests = rng.integers(0, np.iinfo(np.uint64).max, size=(n, 2), dtype=np.uint64, endpoint=True)
    addresses = np.arange(n, dtype=np.uint64)
    rss0 = vm_rss_bytes()
    t0 = time.perf_counter()
    index = KeyIndex()
    index.put_digests(digests, addresses)
    build_s = time.perf_counter() - t0
    rss1 = vm_rss_bytes()
    assert len(index) == n, (len(index), n)

    pool = min(n, 65536)
    sample = rng.choice(n, size=pool, replace=False) if n > pool else np.arange(n)
    keys = hex_keys(digests[sample], rng)
    expect = addresses[sample]
    n_batches = pool // BATCH
    assert n_batches >= 1, "need at least 128 blocks"
    batches = [keys[b * BATCH:(b + 1) * BATCH] for b in range(n_batches)]
    a, f = index.lookup(batches[0])
    assert f.all() and (a == expect[:BATCH]).all(), "lookup returned wrong addresses"

    for i in range(args.warmup):
        index.lookup(batches[i % n_batches])
    times = np.empty(args.batches, dtype=np.int64)
    clock = time.perf_counter_ns
    for i in range(args.batches):
        b = batches[i % n_batches]
        t = clock()
        index.lookup(b)
        times[i] = clock() - t
    us = times / 1000.0

    print(f"python {platform.python_version()}  numpy {np.__version__}  cpus {os.cpu_count()}")
    print(f"blocks {n}  capacity {index.capacity}  build {build_s:.2f}s  batch {BATCH}  "
          f"timed batches {args.batches} (warmup {args.warmup})")
    result = {
        "blocks": n,
        "bytes_per_block": round(index.nbytes / n, 2),
        "rss_bytes_per_block": round((rss1 - rss0) / n, 2),
        "lookup128_us_median": round(float(np.median(us)), 2),
        "lookup128_us_p99": round(float(np.percentile(us, 99)), 2),
        "build_s": round(build_s, 3),
        "capacity": index.capacity,
    }
    line = json.dumps(result)
    print(line)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            fh.write(line + "\n")
    return result


if __name__ == "__main__":
    main()
