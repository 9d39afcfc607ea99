"""``flatcake inspect DIR|REGION``: what a store (a directory, or a region on a device or
pre-sized file) holds, and (``--verify``) whether it is intact.

Opens the store read-only with the layout recorded in its manifest, so it can
look at a store that a running server holds.  Memory-placed blocks live only in
the server's process; an offline look sees the SSD tier.  Given the root a server
was started with (``--flatcake-store-dir``, whose stores sit at
``ROOT/<model>/<rank>``), it names and inspects every store under it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from ..config import FlatCakeConfig
from ..errors import FlatCakeError
from ..recovery import STORE_MANIFEST
from ..store import FlatCakeStore


@dataclass(frozen=True)
class Damage:
    session: int
    segment: int
    offset: int
    bad_ranges: int


def verify_store(store: FlatCakeStore) -> tuple[int, list[Damage]]:
    """Re-read every segment and check every (layer, block) checksum.

    Returns (ranges checked, damaged segments).
    """
    checked = 0
    damage: list[Damage] = []
    lay = store.layout
    for sid, s in sorted(store.sessions.items()):
        with open(store.ssd.path(sid), "rb") as f:
            for seg in s.segments:
                g = seg.geometry
                _, at = store.ssd.io_at(sid, seg.offset)    # a segment never spans two runs
                f.seek(at + g.header_bytes)
                data = np.frombuffer(f.read(g.data_bytes), np.uint8)
                bad = 0
                if data.size < g.data_bytes:
                    bad = lay.layers * g.n_blocks
                else:
                    sec = data.reshape(lay.layers, g.layer_stride)[:, :g.layer_bytes]
                    sec = sec.reshape(lay.layers, g.n_blocks, lay.block_layer_bytes)
                    for l in range(lay.layers):
                        for i in range(g.n_blocks):
                            if xxhash.xxh3_64_intdigest(sec[l, i]) != int(seg.checksums[l, i]):
                                bad += 1
                checked += lay.layers * g.n_blocks
                if bad:
                    damage.append(Damage(sid, seg.seq, seg.offset, bad))
    return checked, damage


def describe(store: FlatCakeStore) -> dict:
    cfg = store.config
    sessions = []
    for sid, s in sorted(store.sessions.items()):
        sessions.append({
            "session": sid, "parent": s.parent, "parent_blocks": s.parent_blocks,
            "label": s.label, "segments": len(s.segments), "blocks": s.n_blocks,
            "turns": sorted({g.turn for g in s.segments}),
            "bytes_data": sum(g.n_blocks for g in s.segments) * store.layout.block_bytes,
            "bytes_file": store.ssd.file_bytes(sid),
        })
    used = store.ssd.used_bytes
    state = ("above high watermark" if used > cfg.high_watermark * cfg.ssd_bytes else
             "between watermarks" if used > cfg.low_watermark * cfg.ssd_bytes else "below low watermark")
    return {
        "root": str(store.config.ssd_path or store.root),
        "layout": store.layout.to_dict(),
        "block_bytes": store.layout.block_bytes,
        "sessions": sessions,
        "totals": {
            "sessions": len(sessions),
            "segments": sum(x["segments"] for x in sessions),
            "blocks_ssd": sum(x["blocks"] for x in sessions),
            "bytes_ssd_data": sum(x["bytes_data"] for x in sessions),
            "bytes_ssd_allocated": used,
            "bytes_memory": 0,
        },
        "watermarks": {"ssd_capacity": cfg.ssd_bytes, "high": cfg.high_watermark,
                       "low": cfg.low_watermark, "usage": used / cfg.ssd_bytes, "state": state},
        "recovery": store.recovery_report,
    }


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.3f} GiB"


def stores_under(root: str | Path) -> list[Path]:
    """The stores one or two levels under ``root`` (``root/<model>/<rank>``), sorted; empty
    when ``root`` is a store itself or holds none."""
    base = Path(root)
    if not base.is_dir() or (base / STORE_MANIFEST).exists():
        return []
    return sorted(m.parent for pattern in (f"*/{STORE_MANIFEST}", f"*/*/{STORE_MANIFEST}")
                  for m in base.glob(pattern))


def run(root: str, verify: bool, as_json: bool, ssd_bytes: int | None = None) -> int:
    """Inspect the store at ``root``, or each store under a ``--flatcake-store-dir`` root;
    the exit code (1: damage found by ``verify``)."""
    base = Path(root)
    if not base.is_dir() or (base / STORE_MANIFEST).exists():
        info, rc = inspect_one(root, verify, ssd_bytes)
        if as_json:
            print(json.dumps(info, indent=1))
        else:
            print_table(info, verify)
        return rc
    found = stores_under(base)
    if not found:
        raise FlatCakeError(f"{root}: no flatcake store here ({STORE_MANIFEST} is neither in it "
                            f"nor in the folders under it, as ROOT/<model>/<rank>/"
                            f"{STORE_MANIFEST})")
    results = [inspect_one(str(p), verify, ssd_bytes) for p in found]
    if as_json:
        print(json.dumps({"store_root": str(base), "stores": [i for i, _ in results]}, indent=1))
    else:
        print(f"{root} is a --flatcake-store-dir root holding {len(found)} "
              f"store{'s' if len(found) != 1 else ''} (one per model and rank):")
        for p in found:
            print(f"  {p}")
        for info, _ in results:
            print()
            print_table(info, verify)
    return max(rc for _, rc in results)


def inspect_one(root: str, verify: bool, ssd_bytes: int | None = None) -> tuple[dict, int]:
    """``(describe(...) plus "verify" when asked, exit code)`` for the one store at ``root``."""
    cfg = FlatCakeConfig(ssd_bytes=ssd_bytes) if ssd_bytes else FlatCakeConfig()
    store = FlatCakeStore.open_existing(root, FlatCakeConfig(**{**cfg.to_dict(), "memory_bytes": 0}))
    try:
        info = describe(store)
        rc = 0
        if verify:
            checked, damage = verify_store(store)
            info["verify"] = {"ranges_checked": checked,
                              "damaged_segments": [d.__dict__ for d in damage]}
            rc = 1 if damage else 0
    finally:
        store.close()                             # removes the scratch root of a region
    return info, rc


def print_table(info: dict, verify: bool) -> None:
    lay = info["layout"]
    print(f"store {info['root']}: {lay['kind']} {lay['layers']} layers x {lay['parts']} parts x "
          f"{lay['part_bytes']} B, {lay['page_tokens']}-token pages, {lay['dtype']} "
          f"({info['block_bytes']} B per block)")
    print(f"{'session':>8} {'parent':>8} {'segs':>5} {'blocks':>7} {'data':>12} {'file':>12}  label")
    for x in info["sessions"]:
        print(f"{x['session']:>8} {str(x['parent'] or '-'):>8} {x['segments']:>5} {x['blocks']:>7} "
              f"{_gib(x['bytes_data']):>12} {_gib(x['bytes_file']):>12}  {x['label']}")
    t, w = info["totals"], info["watermarks"]
    print(f"total: {t['sessions']} sessions, {t['segments']} segments, {t['blocks_ssd']} blocks on SSD "
          f"({_gib(t['bytes_ssd_data'])} data, {_gib(t['bytes_ssd_allocated'])} allocated); "
          f"memory: 0 (volatile, held by the serving process only)")
    print(f"SSD usage {w['usage']:.1%} of {_gib(w['ssd_capacity'])} "
          f"(high {w['high']:.0%}, low {w['low']:.0%}): {w['state']}")
    if info["recovery"]:
        print(f"recovery: {info['recovery']}")
    if verify:
        v = info["verify"]
        if v["damaged_segments"]:
            for d in v["damaged_segments"]:
                print(f"DAMAGED: session {d['session']} segment {d['segment']} at offset {d['offset']}: "
                      f"{d['bad_ranges']} bad (layer, block) ranges")
        print(f"verify: {v['ranges_checked']} ranges checked, "
              f"{len(v['damaged_segments'])} damaged segments")
