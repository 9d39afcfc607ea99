"""A write and a restore, followed call by call: neither climbs back into the facade.

``trace(fn)`` records every call between two modules of the package while ``fn`` runs
(``sys.setprofile``); a *climb* is a call into ``store.py`` made from another module of
the package, i.e. a satellite calling back up into the facade that called it.  Run as a
script (``python tests/store/test_store_hops.py``) it prints both hop lists (docs/store-core.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import sglang_flatcake
from sglang_flatcake.config import FlatCakeConfig
from sglang_flatcake.layout import KVLayout
from sglang_flatcake.placement import WriteSignals
from sglang_flatcake.store import FlatCakeStore

PKG = str(Path(sglang_flatcake.__file__).parent) + "/"
FACADE = "store.py"


def _module(frame) -> str | None:
    f = frame.f_code.co_filename
    return f[len(PKG):] if f.startswith(PKG) else None


def trace(fn) -> list[tuple[str, str, bool]]:
    """``(caller, callee, climb)`` of each call from one package module into another while
    ``fn()`` runs, in order, each distinct edge once; ``module:function`` names."""
    seen: dict[tuple[str, str], bool] = {}

    def prof(frame, event, arg):
        if event != "call":
            return
        callee = _module(frame)
        caller = _module(frame.f_back) if frame.f_back is not None else None
        if callee is None or caller is None or callee == caller:
            return
        edge = (f"{caller}:{frame.f_back.f_code.co_name}", f"{callee}:{frame.f_code.co_name}")
        seen.setdefault(edge, callee == FACADE)

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return [(a, b, c) for (a, b), c in seen.items()]


def _keys(n: int, seed: str) -> list[str]:
    import hashlib
    h, out = hashlib.sha256(seed.encode()).digest(), []
    for i in range(n):
        h = hashlib.sha256(h + i.to_bytes(4, "little")).digest()
        out.append(h.hex())
    return out


def _store(root, region: bool) -> tuple[FlatCakeStore, KVLayout]:
    lay = KVLayout.mha(layers=4, kv_heads=2, head_dim=64, dtype="bfloat16", page_tokens=16)
    medium = {"ssd_path": str(Path(root).parent / "region.img"), "checkpoint_interval": 1} \
        if region else {}
    cfg = FlatCakeConfig(memory_bytes=4 << 20, ssd_bytes=64 << 20, extent_bytes=1 << 20,
                         io_threads=2, io_engine="posix", **medium)
    return FlatCakeStore(root, lay, cfg), lay


def _blocks(lay, n):
    return np.random.default_rng(n).integers(0, 256, (n, lay.block_bytes), dtype=np.uint8)


def write_and_restore_hops(root, region: bool = False) -> tuple[list, list, list]:
    """The hops of one ``put`` (SSD and memory blocks), one ``restore_to_slots`` and one
    ``get`` (a key named twice), on
    session files or (``region``) on a region file checkpointed after every segment."""
    st, lay = _store(root, region)
    try:
        keys = _keys(8, "hops")
        warm = _keys(8, "warm-up")                # compiles the index kernels before the trace
        st.put(warm, _blocks(lay, 8))
        st.get(warm, st.alloc_blocks(8))
        sigs = [WriteSignals(turn=0)] * 4 + [WriteSignals(turn=1)] * 4
        put = trace(lambda: st.put(keys, _blocks(lay, 8), signals=sigs))
        shape = (8 * lay.page_tokens, 2, 64)
        k = [np.zeros(shape, np.uint16) for _ in range(lay.layers)]
        v = [np.zeros(shape, np.uint16) for _ in range(lay.layers)]
        got = {}
        restore = trace(lambda: got.setdefault(
            "r", st.restore_to_slots(keys, k, v, np.arange(8 * lay.page_tokens))))
        assert got["r"].hits == 8
        out = st.alloc_blocks(9)
        get = trace(lambda: got.setdefault("g", st.get(keys + keys[:1], out)))  # one repeat
        assert got["g"].hits == 9
        return put, restore, get
    finally:
        st.close()


@pytest.mark.parametrize("region", [False, True], ids=["files", "region"])
def test_a_write_and_a_restore_never_climb_back_into_the_facade(tmp_path, region):
    put, restore, get = write_and_restore_hops(tmp_path / "s", region)
    assert any(b.startswith("store_write.py") for _, b, _ in put)       # the trace sees hops
    assert any(b.startswith("read/to_slots.py") for _, b, _ in restore)
    climbs = [f"{a} -> {b}" for a, b, c in put + restore + get if c]
    assert climbs == [], "calls back up into store.py: " + "; ".join(climbs)


if __name__ == "__main__":
    import tempfile
    for region in (False, True):
        with tempfile.TemporaryDirectory() as d:
            put, restore, get = write_and_restore_hops(Path(d) / "s", region)
        for name, hops in (("put", put), ("restore_to_slots", restore), ("get", get)):
            print(f"### {name}, {'region' if region else 'session files'}: {len(hops)} "
                  f"cross-module calls, {sum(c for *_, c in hops)} back into store.py")
            for a, b, c in hops:
                print(f"- {'**CLIMB** ' if c else ''}`{a}` -> `{b}`")
