"""An owner node process for tests and benchmarks: a real FlatCakeStore on real files,
filled with one session, served through ``OwnerService``.

``python -m sglang_flatcake.cluster.owner_main --root DIR --blocks N --secret-file F
--node-key-file K --roster-file R [...]``
prints one JSON
line ``{"ready": true, "endpoint": ..., ...}`` and then obeys stdin lines: ``clear`` (free
every session, sweep the directory; prints ``{"cleared": n}``), ``local`` (time a local
``get`` of the session; prints its figures), ``quit``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import numpy as np


def session_keys(n: int, seed: str) -> list[str]:
    """The session's keys: an SGLang-style SHA-256 chain (as tests/conftest.chain)."""
    h, out = hashlib.sha256(seed.encode()).digest(), []
    for i in range(n):
        h = hashlib.sha256(h + i.to_bytes(4, "little")).digest()
        out.append(h.hex())
    return out


def session_blocks(block_bytes: int, keys: list[str]) -> np.ndarray:
    """Contents derived from each key (as tests/conftest.blocks_for), so a mix-up shows."""
    out = np.empty((len(keys), block_bytes), np.uint8)
    for i, k in enumerate(keys):
        out[i] = np.random.default_rng(int(k[:15], 16)).integers(0, 256, block_bytes, np.uint8)
    return out


def _cpu() -> float:
    """User + system CPU seconds of this process, every thread."""
    import resource
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True)
    p.add_argument("--blocks", type=int, required=True)
    p.add_argument("--seed", default="a")
    p.add_argument("--tenant", default="")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-tokens", type=int, default=16)
    p.add_argument("--memory-bytes", type=int, default=0)
    p.add_argument("--ssd-bytes", type=int, default=1 << 30)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--redis", default="")
    p.add_argument("--node", type=int, default=0)
    p.add_argument("--lease-s", type=float, default=2.0)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--slot-blocks", type=int, default=0, help="default: --blocks")
    p.add_argument("--secret-file", required=True, help="the cluster secret")
    p.add_argument("--node-key-file", required=True, help="this node's key (cluster.keygen)")
    p.add_argument("--roster-file", required=True, help="every node's public keys")
    p.add_argument("--raw-bytes", type=int, default=0,
                   help="benchmarks: register a buffer this large (random bytes, no tenant's) "
                        "for a raw Transfer Engine read to compare with (its address: raw_addr)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    from ..config import FlatCakeConfig
    from ..layout import KVLayout
    from ..placement import WriteSignals
    from ..store import FlatCakeStore
    from .owner import OwnerService
    from .secret import ClusterSecret
    from .transfer import Engine
    secret = ClusterSecret.for_node(a.secret_file, a.node, a.node_key_file, a.roster_file)
    layout = KVLayout.mha(layers=a.layers, kv_heads=a.kv_heads, head_dim=a.head_dim,
                          dtype="bfloat16", page_tokens=a.page_tokens)
    cfg = FlatCakeConfig(memory_bytes=a.memory_bytes, ssd_bytes=a.ssd_bytes, node_id=a.node,
                         durable=False)
    store = FlatCakeStore(a.root, layout, cfg)
    keys = session_keys(a.blocks, a.seed)
    t = time.perf_counter()
    # with memory, a later short-chat turn (placed in the arena); else a first turn (SSD)
    signals = WriteSignals(turn=1 if a.memory_bytes else 0)
    put = store.put(keys, session_blocks(layout.block_bytes, keys), signals=signals, label="s")
    put_s = time.perf_counter() - t
    directory = None
    if a.redis:
        from .redis_directory import RedisDirectory
        directory = RedisDirectory(a.redis, secret)
    engine = Engine(a.host)
    raw = np.random.default_rng(0).integers(0, 256, a.raw_bytes, np.uint8)
    raw_addr = engine.register(raw) if a.raw_bytes else None
    svc = OwnerService(store, engine, secret, directory, host=a.host, slots=a.slots,
                       slot_blocks=a.slot_blocks or a.blocks, lease_s=a.lease_s)
    if directory is not None:
        directory.join(a.node, svc.endpoint)
    svc.publish(a.tenant, "s", keys)
    st = store.stats()
    print(json.dumps({"ready": True, "endpoint": svc.endpoint, "te": engine.session,
                      "stored": put.stored, "blocks_ssd": st["blocks_ssd"],
                      "blocks_memory": st["blocks_memory"], "put_s": put_s,
                      "staging_addr": svc.sealed.ctypes.data, "raw_addr": raw_addr}),
          flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "clear":
            n = store.clear()
            svc.sweep(a.tenant)
            print(json.dumps({"cleared": n}), flush=True)
        elif cmd == "local":
            out = store.alloc_blocks(a.blocks)
            t, c = time.perf_counter(), _cpu()
            g = store.get(keys, out)
            dt, dc = time.perf_counter() - t, _cpu() - c
            print(json.dumps({"local_s": dt, "local_cpu_s": dc, "hits": g.hits,
                              "bytes": g.hits * layout.block_bytes,
                              "read_commands": g.read_commands}), flush=True)
        elif cmd == "quit":
            break
    svc.close()
    if directory is not None:
        directory.close()
    engine.close()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
