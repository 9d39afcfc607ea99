"""Opening a store: the directory lock, the manifest, recovery.

Called by ``FlatCakeStore.__init__`` only, on the store core (``store_core.StoreCore``)
before it is ``opened()``.  A refused start raises before the store answers a call, and
the store's ``close()`` then releases what was taken.  Recovery rebuilds the session
table and the index from what the SSD tier scans (session files or the region's
checkpoint and journal); a session left with no segment is released, a torn header
zeroed.  ``existing`` (a store as its manifest records it) lives in ``store_existing``.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from .errors import FlatCakeError, LayoutMismatchError, UnsafeStoreError
from .private_fs import open_file
from .store_core import StoreCore
from .recovery import (STORE_MANIFEST, atomic_write_json, check_store_manifest, read_json,
                       store_manifest)
from .tiers.ssd_recovery import check_orphan_files
from .store_existing import existing

__all__ = ["take_lock", "check_manifest", "recover", "existing"]

log = logging.getLogger("sglang_flatcake")


def take_lock(root: Path) -> int:
    """An exclusive lock on ``root/.lock``; ``FlatCakeError`` when another process holds it."""
    try:
        fd = open_file(root / ".lock", os.O_RDWR, create=True)[0]
    except OSError as e:
        raise UnsafeStoreError(f"cannot open the lock file {root / '.lock'}: "
                               f"{e.strerror} (a symlink is never followed)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FlatCakeError(f"store {root} is in use by another process "
                            "(each server rank needs its own store directory)") from None
    return fd


def check_manifest(core: StoreCore, root: Path, read_only: bool) -> None:
    """Check (or write) ``flatcake.json`` against the store's layout; a tier that keeps
    the layout on its medium (a region) checked it when it opened."""
    mpath = root / STORE_MANIFEST
    ssd, lay, cfg = core.ssd, core.layout, core.config
    if ssd.keeps_layout:
        return
    if mpath.exists():
        try:
            check_store_manifest(read_json(mpath), lay, cfg.alignment, root)
        except LayoutMismatchError:
            if read_only or cfg.on_layout_mismatch != "reset":
                raise
            log.warning("store %s: layout mismatch, resetting it empty as asked", root)
            ssd.reset()
            atomic_write_json(mpath, store_manifest(lay, cfg.alignment))
    elif not read_only:
        check_orphan_files(ssd.dir, lay, cfg.alignment, root,
                           cfg.on_layout_mismatch == "reset")
        atomic_write_json(mpath, store_manifest(lay, cfg.alignment))


def recover(core: StoreCore, root: Path, read_only: bool) -> dict:
    """Rebuild the session table and the index from the SSD tier (under the core's
    lock); returns the report."""
    ssd, cfg = core.ssd, core.config
    with core.locked() as t:
        sessions, rep, torn = ssd.load(core.layout, cfg.alignment,
                                       cfg.start_empty and not read_only)
        t.next_sid = max(t.next_sid, ssd.next_sid)
        for s in sessions:
            t.next_sid = max(t.next_sid, s.sid + 1)
            if not s.segments:
                if not read_only:
                    ssd.release(s.sid)
                continue
            t.add(s)
            ssd.adopt(s.sid, torn[s.sid][1])
            for seg in s.segments:
                t.index_segment(s, seg)
            torn_at, size = torn[s.sid]
            if not read_only and size - torn_at >= cfg.alignment:
                # zero a torn header, if any, so a later scan cannot misread it
                ssd.zero_at(s.sid, torn_at, cfg.alignment)
        for s in t.sessions.values():
            if s.parent is not None and s.parent >= s.sid:   # a parent is always older
                log.warning("store %s: session %d names %d as its parent; treated as a root",
                            root, s.sid, s.parent)
                s.parent, rep["bad_parents"] = None, rep["bad_parents"] + 1
            if s.parent in t.sessions:
                t.sessions[s.parent].children.add(s.sid)
        if not read_only:
            ssd.cleanup(set(t.sessions), rep)
    if rep:
        log.info("store %s recovered: %s", root, dict(rep))
    return dict(rep)
