"""Child process for test_crash: writes turns forever, acknowledging each on stdout.

argv: STORE_DIR SEED.  Session s, turn t has keys extend(chain(4, f"{seed}-{s}"), ...),
deterministic contents (blocks_for), so the parent can check every byte.
"""

import sys

from conftest import blocks_for, chain, extend
from sglang_flatcake.config import FlatCakeConfig
from sglang_flatcake.layout import KVLayout
from sglang_flatcake.placement import WriteSignals
from sglang_flatcake.store import FlatCakeStore

LAYOUT = KVLayout.mha(layers=4, kv_heads=2, head_dim=64, dtype="bfloat16", page_tokens=16)
CONFIG = FlatCakeConfig(memory_bytes=0, ssd_bytes=1 << 30, extent_bytes=1 << 20, io_threads=2)


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
    with FlatCakeStore(root, LAYOUT, CONFIG) as st:
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
