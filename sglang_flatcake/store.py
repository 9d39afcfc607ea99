"""The store facade: put, exists, locate, plan, get, reclaim, stats.

The facade checks arguments and hands each call to the path that does it; the state
those paths share (the locks, the session table, the pins, the counters) has one owner,
the store core (``store_core.StoreCore``), and they depend on it, never on this class:

- a write is one transaction (``StoreCore.write``: writers are serialised; SGLang backs
  up from one thread) that pins its session for its whole duration, so reclaim cannot
  take it (``store_write``);
- the core's lock (``StoreCore.locked``) guards the index, the session table, the
  arena's slot table and the SSD extent map.  I/O never runs under it;
- a read pins every session it touches from planning until its bytes are copied out
  (``read.read_lease``); reclaim skips pinned sessions, so a read never sees freed space.

Blocks cross the API in the canonical shape ``(n, layers, block_layer_bytes)``
uint8 (any array whose bytes are that, e.g. a flat ``(n, block_bytes)``).
A miss is a value: ``exists`` and ``get`` return the length of the leading run
of blocks that are stored (and, for ``get``, verified).  A key list given as one
``str`` is refused (``TypeError``), never read as one key per character.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections import Counter
from contextlib import nullcontext
from pathlib import Path
from typing import Sequence

import numpy as np

from . import address as addr
from . import store_open as opening
from .config import FlatCakeConfig
from .errors import FlatCakeError
from .index import KeyIndex
from .keys import key_digest, key_digests
from .io import make_engine
from .layout import KVLayout
from .placement import WriteSignals
from .private_fs import private_dir
from .read import get as get_path
from .read.planner import ReadPlan, empty_plan, plan_reads
from .read.read_lease import ReadLease, open_lease
from .read.resolve import resolve
from .read.restore import VectoredReader
from .results import GetResult, PutResult
from .session_table import Lineage
from .sessions import Session
from .store_checks import (as_blocks, check_count, check_keys, check_label, check_out,
                           check_signals, check_unique)
from .store_core import StoreCore
from .store_write import put_batch
from .store_stats import store_stats
from .tiers import open_tier
from .tiers.memory import HostArena

__all__ = ["FlatCakeStore", "GetResult", "Lineage", "PutResult"]

log = logging.getLogger("sglang_flatcake")


class FlatCakeStore:
    """A FlatCake store rooted at a directory.  Not shared between processes.

    The SSD tier is a directory of session files under ``root`` (``tiers.ssd``), or, with
    ``config.ssd_path``, one block device or pre-sized file (``tiers.region``).  ``root``
    is made private (0700) or refused when other users could reach it (``private_fs``);
    every call after ``close()`` raises ``StoreClosedError``.  ``scratch_root``: ``root``
    is a scratch directory (``open_existing`` on a region), removed on close.

    Its parts, for reading: ``core`` (the state, see ``store_core``), ``engine``,
    ``reader``, and the core's ``index``, ``arena``, ``ssd``, ``table``, ``reclaimer``."""

    def __init__(self, root: str | os.PathLike, layout: KVLayout,
                 config: FlatCakeConfig | None = None, read_only: bool = False,
                 scratch_root: bool = False) -> None:
        self.layout = layout
        self.config = config or FlatCakeConfig()
        self.read_only = read_only
        self._released = False        # tier and engine closed
        self._scratch_root = scratch_root
        self.core: StoreCore | None = None   # until the tier has opened
        self.ssd = None
        self.root = Path(root).resolve() if read_only else private_dir(root)
        self._lockfd = None if read_only else opening.take_lock(self.root)
        self.engine = make_engine(self.config.io_engine, self.config.alignment, self.config.io_threads)
        self.index = KeyIndex()
        self.arena = HostArena(0 if read_only else self.config.memory_bytes, layout.block_bytes)
        self.recovery_report: dict = {}
        self.reader = VectoredReader(self.engine, self.config.merge_gap_bytes)
        try:
            self.ssd = open_tier(self.config, layout, self.engine, self.root, read_only)
            self.core = core = StoreCore(str(self.root), layout, self.config, self.index,
                                         self.arena, self.ssd)
            self.table, self.reclaimer = core.table, core.reclaimer
            opening.check_manifest(core, self.root, read_only)
            self.recovery_report = opening.recover(core, self.root, read_only)
            core.opened()
        except BaseException:
            self.close()          # a refused start leaves the directory as it was, and unlocked
            raise

    @classmethod
    def open_existing(cls, root: str | os.PathLike, config: FlatCakeConfig | None = None,
                      read_only: bool = True) -> "FlatCakeStore":
        """Open a store with the layout recorded in its manifest (for inspection).

        ``root`` is a store directory, or a region (a block device or pre-sized file written
        with ``ssd_path``), whose superblock records the layout; a region is opened with a
        scratch directory as its root, removed on close.
        """
        root, layout, cfg, scratch = opening.existing(root, config)
        try:
            return cls(root, layout, cfg, read_only=read_only, scratch_root=scratch)
        except BaseException:
            if scratch:
                shutil.rmtree(root, ignore_errors=True)
            raise

    # ------------------------------------------------------------------ session table
    @property
    def sessions(self) -> dict[int, Session]:
        return self.table.sessions

    @property
    def counters(self) -> Counter:
        """A copy of the counters that moved (``stats()`` reports every one)."""
        return self.core.counts()

    # ------------------------------------------------------------------ write
    def put(self, keys: Sequence[str], blocks: np.ndarray, prefix_keys: Sequence[str] = (),
            signals: WriteSignals | Sequence[WriteSignals] | None = None,
            label: str = "") -> PutResult:
        """Store the blocks of ``keys`` (in chain order) that are not stored yet.

        ``prefix_keys`` are the keys before ``keys[0]`` in the chain; they decide
        whether the write continues a session, branches one, or starts one.
        Never raises for a full disk or capacity: those blocks are reported as
        ``failed`` and nothing of them is kept.  A key named twice in one batch, or a
        ``label`` that is not a str of at most 256 UTF-8 bytes, raises ``ValueError``
        (``TypeError``) before anything is written.
        """
        self.core.check_open()
        if self.read_only:
            raise FlatCakeError("store is open read-only")
        check_keys(keys, "put")
        check_keys(prefix_keys, "put", "prefix_keys")
        check_label(label)
        n = len(keys)
        blocks = as_blocks(self.layout, blocks, n)
        if n == 0:
            return PutResult(0, 0, 0, None)
        sigs = check_signals(signals, n)
        dig = key_digests(keys)
        check_unique(keys, dig)
        return put_batch(self.core, dig, blocks, prefix_keys, sigs, label)

    def exists(self, keys: Sequence[str]) -> int:
        """Length of the leading run of ``keys`` that are stored."""
        self.core.check_open()
        check_keys(keys, "exists")
        if not keys:
            return 0
        with self.core.locked() as table:
            _, found = table.index.lookup_digests(key_digests(keys))
        miss = np.nonzero(~found)[0]
        return int(miss[0]) if len(miss) else len(keys)

    def lineage(self, key: str) -> Lineage | None:
        """What the store knows of the session that holds ``key`` (None for a miss)."""
        self.core.check_open()
        with self.core.locked() as table:
            return table.lineage(np.frombuffer(key_digest(key), "<u8").reshape(1, 2))

    def locate(self, keys: Sequence[str]) -> list[addr.Address | None]:
        """The address of each key, or ``None`` for a miss (one index lookup per key)."""
        self.core.check_open()
        check_keys(keys, "locate")
        with self.core.locked() as table:
            a, found = table.index.lookup_digests(key_digests(keys))
        return [addr.decode(int(x)) if ok else None for x, ok in zip(a, found)]

    def plan(self, keys: Sequence[str], split_layers: bool = True) -> ReadPlan:
        """The SSD read plan for the leading stored run of ``keys`` (no I/O, no pins kept)."""
        self.core.check_open()
        check_keys(keys, "plan")
        res = resolve(self.core, keys, pin=False)
        if not res.reads:
            return empty_plan(self.layout.block_layer_bytes)
        return plan_reads(res.reads, self.config.alignment, self.config.merge_gap_bytes, split_layers)

    def read_lease(self, keys: Sequence[str]) -> ReadLease:
        """Resolve and pin the leading stored run of ``keys`` for one read (see
        ``read_lease.ReadLease``); release it (or use ``with``) when its bytes are copied."""
        self.core.check_open()
        check_keys(keys, "read_lease")
        return open_lease(self.core, keys)

    def alloc_blocks(self, n: int) -> np.ndarray:
        """An aligned ``(n, layers, block_layer_bytes)`` buffer: ``get`` reads straight into it
        (an unaligned ``out`` works too, through the bounce buffer, at a cost)."""
        check_count(n, "alloc_blocks", "n")
        return self.engine.alloc(n * self.layout.block_bytes).reshape(
            n, self.layout.layers, self.layout.block_layer_bytes)

    def get(self, keys: Sequence[str], out: np.ndarray) -> GetResult:
        """Restore the leading stored run of ``keys`` into ``out`` (canonical block shape).

        Returns how many leading blocks were restored *and verified*: a block
        whose checksum fails is a miss (it and everything after it), never
        wrong bytes.  An I/O error fails the whole read (``hits == 0``).  ``out`` must be
        C-contiguous (``ValueError``).  A key may repeat: ``hits`` counts positions served,
        ``from_memory``/``from_ssd`` the distinct blocks read.
        """
        self.core.check_open()
        check_keys(keys, "get")
        return get_path.get(self.core, self.reader, keys, check_out(out))

    def restore_to_slots(self, keys: Sequence[str], dest_k, dest_v, slot_indices, window=None,
                         order: str = "layer"):
        """Restore straight into paged KV slots through the two-layer window (no staging).

        ``dest_k``/``dest_v`` are per-layer device (or CPU) buffers shaped like SGLang's
        pools; see ``to_slots.restore_through_window`` for the contract.
        """
        from .read.to_slots import restore_through_window
        self.core.check_open()
        check_keys(keys, "restore_to_slots")
        return restore_through_window(self, keys, dest_k, dest_v, slot_indices, window=window,
                                      order=order)

    # ------------------------------------------------------------------ reclaim
    def reclaim(self) -> list[int]:
        """Run reclaim now; returns the freed session ids."""
        self.core.check_open()
        with self.core.write():
            return self.reclaimer.maybe_reclaim()

    def clear(self) -> int:
        """Free every session no reader holds; returns how many were freed."""
        self.core.check_open()
        with self.core.write():
            return self.reclaimer.clear()

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """Sessions, blocks and bytes per medium, capacities, index size, every counter
        (``results.COUNTERS`` and one per placement rule, zero when unused), I/O stats."""
        self.core.check_open()
        return store_stats(self.core, self.engine)

    def close(self) -> None:
        """Checkpoint (region medium), stop I/O and release the store directory.  Waits
        for a write in flight; a second call does nothing."""
        core = self.core
        with core.closing() if core is not None else nullcontext(False) as was_open:
            if was_open and not self.read_only:
                core.checkpoint()
            if not self._released:       # also after a refused start (never opened)
                self._released = True
                if self.ssd is not None:
                    self.ssd.close()
                self.engine.close()
            if self._lockfd is not None:
                os.close(self._lockfd)
                self._lockfd = None
            if self._scratch_root:
                shutil.rmtree(self.root, ignore_errors=True)
                self._scratch_root = False

    def __enter__(self) -> "FlatCakeStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
