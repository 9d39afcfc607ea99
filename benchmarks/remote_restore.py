"""One long session restored remotely (another process, through the Transfer Engine) and
locally, next to the Transfer Engine's own bandwidth for the same bytes, in the same run.

    python benchmarks/remote_restore.py [--blocks 256] [--medium ssd|memory] [--repeat 5]
                                        [--json OUT]

An owner node process (``sglang_flatcake.cluster.owner_main``: a real FlatCakeStore on real
files) stores one session.  This process then alternates, ``--repeat`` times:
(a) remote restore with the cluster secure (issues 20, 32): ``RemoteReader.fetch``
(authenticated messages, the owner's merged O_DIRECT reads of SSD blocks, every block sealed
with AES-256-GCM under the grant's key into a staging slot registered for that grant only --
memory-tier blocks straight from the arena --, one Transfer Engine batch per chunk into
unregistered memory, every block opened with the key, then checked against the writer's
publish-time record -- xxh3_64 per (block, layer), then a keyed BLAKE2b over them --, ack
and unregister, copy into ``out``; ``--no-copy``: the blocks stay in the opened buffer, as a
server's restore scatters them from there);
(b) the Transfer Engine alone: one read of the same number of bytes from a buffer the owner
registered for this (no store, no checksums, no authentication);
(c) local restore: ``store.get`` of the session inside the owner process
(``local_cpu_s_per_gib``: that process's CPU for it -- the store's own read, which a remote
restore of SSD blocks pays on the owner and a raw Transfer Engine read does not).
Reports medians and bests; ``ratio_remote_vs_te`` = TE time / remote time (issue 13 target
>= 0.80), from medians, and ``ratio_best_remote_vs_te`` from the fastest round of each (on a
shared machine the medians swing with the other load).  CPU: ``*_cpu_s_per_gib`` is the CPU
time of both processes (requester + owner, every thread, user + system) per GiB moved, for
(a) and (b), medians; ``verify_cpu_s_per_gib`` is the requester's xxh3 check of every
(block, layer) alone, timed on its own; ``seal_cpu_s_per_gib`` and ``open_cpu_s_per_gib``
the owner's sealing and the requester's opening of every block, each timed on its own.
Prints its configuration and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sglang_flatcake.cluster.identity import roster_line  # noqa: E402
from sglang_flatcake.cluster.owner_main import session_keys  # noqa: E402
from sglang_flatcake.cluster.requester import RemoteReader  # noqa: E402
from sglang_flatcake.cluster.secret import ClusterSecret  # noqa: E402
from sglang_flatcake.cluster.transfer import Engine  # noqa: E402
from sglang_flatcake.cluster.wire import block_record  # noqa: E402


def seal_cost(secret, buf, keys):
    """CPU seconds of sealing every block of ``buf`` (the owner's part) and of opening them
    again (the requester's part), as ``seal`` does for one grant."""
    from sglang_flatcake.cluster.seal import grant_cipher, open_block, seal_block, sealed_bytes
    aead, tag = grant_cipher(secret, 1, 0, "00" * 16), secret.tag("")
    sealed = np.ones((len(keys), sealed_bytes(buf[0].nbytes)), np.uint8)   # pages touched,
    out = np.ones_like(buf[0])                   # as the owner's reused slots are
    t = time.process_time()
    for i, k in enumerate(keys):
        seal_block(aead, i, tag, k, buf[i], sealed[i])
    mid = time.process_time()
    for i, k in enumerate(keys):
        if not open_block(aead, i, tag, k, sealed[i], out):
            raise RuntimeError("a sealed block did not open")
    return mid - t, time.process_time() - mid


def verify_cost(secret, buf, keys, layers):
    """CPU seconds of checking every block of ``buf`` against its record, and of the MACs
    alone (as ``RemoteReader`` does)."""
    import xxhash
    h, tag = xxhash.xxh3_64_intdigest, secret.tag("")
    sums = np.empty((len(keys), layers), np.uint64)
    t = time.process_time()
    for i in range(len(keys)):
        for j in range(layers):
            sums[i, j] = h(buf[i, j])
    mid = time.process_time()
    for i, k in enumerate(keys):
        block_record(secret, tag, k, sums[i])
    end = time.process_time()
    return end - t, end - mid
from sglang_flatcake.layout import KVLayout  # noqa: E402


def cpu_of(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (every thread)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(fn, owner_pid: int):
    """``fn()``'s result, wall seconds and CPU seconds of this process plus the owner's."""
    t, c, o = time.perf_counter(), time.process_time(), cpu_of(owner_pid)
    r = fn()
    return (r, time.perf_counter() - t,
            time.process_time() - c + cpu_of(owner_pid) - o)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=256, help="pages in the session")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-tokens", type=int, default=64)
    p.add_argument("--medium", choices=("ssd", "memory"), default="ssd")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--chunk-blocks", type=int, default=16,
                   help="pipelined chunks (0: the whole session in one grant and one transfer)")
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--dir", default=None, help="parent of the owner's store (default: a temp dir)")
    p.add_argument("--no-copy", action="store_true",
                   help="leave the verified blocks in the receive buffer (no copy into out)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    layout = KVLayout.mha(layers=a.layers, kv_heads=a.kv_heads, head_dim=a.head_dim,
                          dtype="bfloat16", page_tokens=a.page_tokens)
    nbytes = a.blocks * layout.block_bytes
    cfg = {"blocks": a.blocks, "tokens": a.blocks * a.page_tokens, "layers": a.layers,
           "block_bytes": layout.block_bytes, "session_bytes": nbytes, "medium": a.medium,
           "repeat": a.repeat, "chunk_blocks": a.chunk_blocks, "copy_into_out": not a.no_copy,
           "protocol": "tcp", "host": "127.0.0.1",
           "machine": f"{platform.machine()} {os.cpu_count()} cpus"}
    print("config", json.dumps(cfg), flush=True)
    tmp = tempfile.mkdtemp(prefix="fc-remote-", dir=a.dir)
    secret_path = os.path.join(tmp, "secret")
    with open(os.open(secret_path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(os.urandom(32).hex().encode())
    seeds = {}                              # the owner is node 0, this process node 1
    for node in (0, 1):
        seeds[node] = os.urandom(32)
        with open(os.open(os.path.join(tmp, f"node{node}.key"), os.O_WRONLY | os.O_CREAT,
                          0o600), "w") as f:
            f.write(seeds[node].hex())
    with open(os.open(os.path.join(tmp, "roster"), os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write("".join(roster_line(n, sd) + "\n" for n, sd in seeds.items()))
    secret = ClusterSecret.for_node(secret_path, 1, os.path.join(tmp, "node1.key"),
                                    os.path.join(tmp, "roster"))
    chunk = a.chunk_blocks or a.blocks
    slots = -(-a.blocks // chunk) + 1        # staging holds the whole session (for the raw read)
    extra = ["--memory-bytes", str(2 * nbytes)] if a.medium == "memory" else []
    owner = subprocess.Popen(
        [sys.executable, "-m", "sglang_flatcake.cluster.owner_main", "--root", f"{tmp}/store",
         "--blocks", str(a.blocks), "--layers", str(a.layers), "--kv-heads", str(a.kv_heads),
         "--head-dim", str(a.head_dim), "--page-tokens", str(a.page_tokens),
         "--ssd-bytes", str(4 * nbytes + (64 << 20)), "--slots", str(slots), "--slot-blocks", str(chunk),
         "--secret-file", secret_path, "--raw-bytes", str(nbytes), "--node", "0",
         "--node-key-file", os.path.join(tmp, "node0.key"), "--roster-file",
         os.path.join(tmp, "roster"), *extra],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        info = json.loads(owner.stdout.readline())
        keys = session_keys(a.blocks, "a")
        engine = Engine("127.0.0.1")
        reader = RemoteReader(engine, layout, secret, max_blocks=a.blocks,
                              timeout_s=a.timeout_s, chunk_blocks=a.chunk_blocks)
        out = np.empty((a.blocks, layout.layers, layout.block_layer_bytes), np.uint8)
        raw = np.empty(nbytes, np.uint8)      # unregistered, as the remote restore's buffer
        raw_addr = raw.ctypes.data
        remote, te, local, grant, cpu_r, cpu_t, cpu_l = [], [], [], [], [], [], []
        for i in range(a.repeat + 1):           # the first round warms connections up
            r, dt, cr = timed(lambda: reader.fetch(info["endpoint"], "", keys,
                                                   None if a.no_copy else out), owner.pid)
            if r.hits != a.blocks:
                raise RuntimeError(f"remote restore served {r.hits}/{a.blocks}: {r.reason}")
            ok, tt, ct = timed(lambda: engine.read(info["te"], [raw_addr], [info["raw_addr"]],
                                                   [nbytes], a.timeout_s), owner.pid)
            if not ok.ok:
                raise RuntimeError(f"raw Transfer Engine read failed: {ok.reason}")
            owner.stdin.write("local\n")
            owner.stdin.flush()
            lo = json.loads(owner.stdout.readline())
            if i:
                remote.append(dt)
                grant.append(r.grant_seconds)
                te.append(tt)
                local.append(lo["local_s"])
                cpu_l.append(lo["local_cpu_s"])
                cpu_r.append(cr)
                cpu_t.append(ct)
            print(f"round {i}: remote {dt * 1e3:.1f} ms (cpu {cr * 1e3:.0f} ms), te {tt * 1e3:.1f} ms "
                  f"(cpu {ct * 1e3:.0f} ms), local {lo['local_s'] * 1e3:.1f} ms", flush=True)
        verify_cpu, mac_cpu = verify_cost(secret, reader.buf, keys, layout.layers)
        seal_cpu, open_cpu = seal_cost(secret, reader.buf, keys)
        med = statistics.median
        gib = nbytes / (1 << 30)
        res = dict(cfg, remote_s=med(remote), remote_grant_s=med(grant), te_s=med(te), local_s=med(local),
                   remote_gibps=gib / med(remote), te_gibps=gib / med(te),
                   local_gibps=gib / med(local), ratio_remote_vs_te=med(te) / med(remote),
                   ratio_remote_vs_local=med(local) / med(remote),
                   best_remote_s=min(remote), best_te_s=min(te), best_local_s=min(local),
                   ratio_best_remote_vs_te=min(te) / min(remote),
                   remote_cpu_s_per_gib=med(cpu_r) / gib, te_cpu_s_per_gib=med(cpu_t) / gib,
                   ratio_cpu_remote_vs_te=med(cpu_r) / med(cpu_t),
                   local_cpu_s_per_gib=med(cpu_l) / gib,
                   verify_cpu_s_per_gib=verify_cpu / gib, mac_cpu_s_per_gib=mac_cpu / gib,
                   seal_cpu_s_per_gib=seal_cpu / gib, open_cpu_s_per_gib=open_cpu / gib,
                   owner_read_commands=r.owner_read_commands)
        print(json.dumps(res), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        owner.stdin.write("quit\n")
        owner.stdin.flush()
        owner.wait(timeout=30)
        engine.close()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        subprocess.run(["rm", "-rf", tmp], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
