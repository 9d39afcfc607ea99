"""The store manifest: ``flatcake.json``, format version and layout, checked at start.

A store opened with another layout is refused (or reset when asked); the region
medium keeps the same manifest in its superblock.  ``atomic_write_json`` (temporary
file, fsync, rename) and ``read_json`` are how every small JSON file of the store is
written and read (the session manifests of ``tiers.ssd`` too).  The segment format is
``segment.py``; each medium's recovery is ``tiers.ssd_recovery`` and
``tiers.region_recovery``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from . import FORMAT_VERSION, __version__
from .errors import LayoutMismatchError, StoreCorruptError
from .layout import KVLayout

STORE_MANIFEST = "flatcake.json"


# -- manifests -------------------------------------------------------------------

def atomic_write_json(path: Path, obj: dict, fsync: bool = True) -> None:
    """Write ``obj`` to ``path`` so that a crash leaves the old file or the new one
    (durable across power loss only with ``fsync``).  The temporary file is created new
    (``O_EXCL | O_NOFOLLOW``, mode 0600: a planted link is never written through; a stale
    one is removed first).  An ``OSError`` (a full disk) leaves no temporary file behind."""
    from .private_fs import create_new
    tmp = path.with_name(path.name + ".tmp")
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    try:
        fd = create_new(tmp)
    except FileExistsError:
        os.unlink(tmp)                      # left by a crash (or planted): never followed
        fd = create_new(tmp)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if not fsync:
        return
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StoreCorruptError(f"{path}: cannot read ({e})") from None


def store_manifest(layout: KVLayout, alignment: int) -> dict:
    return {"format": FORMAT_VERSION, "layout": layout.to_dict(), "alignment": alignment,
            "created": time.time(), "written_by": f"sglang-flatcake {__version__}"}


def check_store_manifest(manifest: dict, layout: KVLayout, alignment: int, root: Path) -> None:
    """Raise ``LayoutMismatchError`` naming every field that differs."""
    diffs = []
    if manifest.get("format") != FORMAT_VERSION:
        diffs.append(f"format version {manifest.get('format')!r} (this build reads {FORMAT_VERSION})")
    if manifest.get("alignment") != alignment:
        diffs.append(f"alignment {manifest.get('alignment')!r} != {alignment}")
    stored = manifest.get("layout") or {}
    for k, v in layout.to_dict().items():
        if stored.get(k) != v:
            diffs.append(f"{k} {stored.get(k)!r} != {v!r}")
    if diffs:
        raise LayoutMismatchError(
            f"store {root} was written with another layout: " + "; ".join(diffs)
            + ". Point the store at another directory, or start it with "
              "on_layout_mismatch=reset (--flatcake-on-layout-mismatch reset) to empty it.")
