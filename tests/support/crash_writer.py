"""Child process for ``tests/store/test_crash.py`` (``python -m tests.support.crash_writer``): writes turns forever, acknowledging each on stdout.

argv: STORE_DIR SEED [REGION_FILE].  With REGION_FILE the SSD tier is that pre-sized
file (the region medium, a checkpoint every few segments) instead of session files.  Session s, turn t has keys extend(chain(4, f"{seed}-{s}"), ...),
deterministic contents (blocks_for), so the parent can check every byte.
"""

import sys

from sglang_flatcake.config import FlatCakeConfig
from sglang_flatcake.layout import KVLayout
from sglang_flatcake.placement import WriteSignals
from sglang_flatcake.store import FlatCakeStore
from tests.support import blocks_for, chain, extend

LAYOUT = KVLayout.mha(layers=4, kv_heads=2, head_dim=64, dtype="bfloat16", page_tokens=16)
CONFIG = FlatCakeConfig(memory_bytes=0, ssd_bytes=1 << 30, extent_bytes=1 << 20, io_threads=2)


def config_for(region: str = "") -> FlatCakeConfig:
    if not region:
        return CONFIG
    return FlatCakeConfig(memory_bytes=0, ssd_bytes=256 << 20, extent_bytes=1 << 20, io_threads=2,
                          ssd_path=region, checkpoint_interval=7)


def turn_keys(seed: str, s: int, t: int) -> tuple[list[str], list[str]]:
    """(prefix keys, this turn's keys) of session s, turn t."""
    keys = chain(4, f"{seed}-{s}")
    prefix: list[str] = []
    for i in range(t):
        prefix += keys
        keys = extend(keys, 3 + (i % 4), f"t{i}")
    return prefix, keys


def main() -> None:
    root, seed = sys.argv[1], sys.argv[2]
    with FlatCakeStore(root, LAYOUT, config_for(sys.argv[3] if len(sys.argv) > 3 else "")) as st:
        print("READY", flush=True)
        for t in range(1000):
            for s in range(3):
                prefix, keys = turn_keys(seed, s, t)
                r = st.put(keys, blocks_for(LAYOUT, keys), prefix_keys=prefix,
                           signals=WriteSignals(turn=t, prev_reply_tokens=10_000))
                assert r.stored + r.existing == len(keys), r
                print(f"ACK {s} {t}", flush=True)


if __name__ == "__main__":
    main()
