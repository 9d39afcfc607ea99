"""SSD tiers of the tiered baselines: where demoted blocks go and how they are read.

Both tiers do real O_DIRECT I/O through ``PosixEngine``: one write command per
run of adjacent slots, one read command per block (blocks of many sessions
interleave in eviction order, so a restore is scattered per block).
"""

from __future__ import annotations

import abc
import heapq
from collections import OrderedDict, deque
from pathlib import Path
from typing import Sequence

import numpy as np

from ...io.base import ReadCommand
from ...io.posix import PosixEngine
from .base import DataPool


class ReadJob:
    """Real reads in flight; ``wait()`` returns when all are done (raises on I/O error)."""

    def __init__(self, handles: list, nbytes: int, commands: int) -> None:
        self._handles = handles
        self.nbytes = nbytes
        self.commands = commands

    def wait(self) -> None:
        for h in self._handles:
            h.wait()


class SsdTier(abc.ABC):
    def __init__(self, engine: PosixEngine, block_bytes: int, pool: DataPool) -> None:
        self.engine = engine
        self.block_bytes = block_bytes
        self.pool = pool

    @abc.abstractmethod
    def has(self, key: str) -> bool: ...

    def touch(self, key: str) -> None:
        """Record an SSD hit (recency); no-op for tiers that ignore it."""

    @abc.abstractmethod
    def store(self, keys: Sequence[str]) -> tuple[int, int]:
        """Write ``keys`` (not yet on SSD) in order; returns (real bytes, write commands).
        May drop other blocks to make room."""

    @abc.abstractmethod
    def read(self, keys: Sequence[str], targets: Sequence[np.ndarray]) -> ReadJob:
        """Start reading ``keys`` (all present) into ``targets``, one block each."""

    def _write_runs(self, path_of, placed: list[tuple[int, int]]) -> tuple[int, int]:
        """Write placed (file, slot) pairs, one command per run of adjacent slots."""
        bb = self.block_bytes
        nbytes = cmds = 0
        placed = sorted(placed)
        i = 0
        while i < len(placed):
            j = i + 1
            while j < len(placed) and placed[j] == (placed[i][0], placed[i][1] + j - i):
                j += 1
            f, s = placed[i]
            data = self.pool.blocks(j - i)
            self.engine.write(path_of(f), s * bb, data)
            nbytes += data.nbytes
            cmds += 1
            i = j
        return nbytes, cmds

    def _read(self, where: list[tuple[str, int]], targets: Sequence[np.ndarray]) -> ReadJob:
        bb = self.block_bytes
        cmds = [ReadCommand(p, s * bb, bb) for p, s in where]
        return ReadJob(self.engine.submit(cmds, list(targets)), len(cmds) * bb, len(cmds))


class SlotTier(SsdTier):
    """One pre-allocated file of block slots.  A demoted block takes the lowest free
    slot; when none is free the least recently used SSD block is dropped."""

    def __init__(self, root: Path, engine: PosixEngine, capacity_blocks: int,
                 block_bytes: int, pool: DataPool) -> None:
        super().__init__(engine, block_bytes, pool)
        self.path = str(root / "slots.bin")
        self.capacity = capacity_blocks
        engine.allocate(self.path, max(1, capacity_blocks) * block_bytes)
        self._slot: OrderedDict[str, int] = OrderedDict()     # LRU first
        self._free = list(range(capacity_blocks))
        self.dropped = 0

    def has(self, key: str) -> bool:
        return key in self._slot

    def touch(self, key: str) -> None:
        self._slot.move_to_end(key)

    def store(self, keys: Sequence[str]) -> tuple[int, int]:
        placed = []
        for k in keys:
            if k in self._slot or self.capacity == 0:
                continue
            if not self._free:
                _, s = self._slot.popitem(last=False)
                heapq.heappush(self._free, s)
                self.dropped += 1
            s = heapq.heappop(self._free)
            self._slot[k] = s
            placed.append((0, s))
        return self._write_runs(lambda _: self.path, placed)

    def read(self, keys: Sequence[str], targets: Sequence[np.ndarray]) -> ReadJob:
        return self._read([(self.path, self._slot[k]) for k in keys], targets)


class BucketTier(SsdTier):
    """Mooncake-style buckets: fixed-size bucket files filled in eviction order (so a
    bucket mixes sessions); when no bucket is free the oldest is recycled whole,
    first in first out, dropping every block in it whatever session it belongs to."""

    def __init__(self, root: Path, engine: PosixEngine, capacity_blocks: int,
                 block_bytes: int, pool: DataPool, bucket_blocks: int) -> None:
        super().__init__(engine, block_bytes, pool)
        self.root = root
        self.bucket_blocks = max(1, min(bucket_blocks, capacity_blocks))   # an SSD under one bucket
        self.n_buckets = capacity_blocks // self.bucket_blocks              # gets one bucket
        self._where: dict[str, tuple[int, int]] = {}
        self._members: list[list[str]] = [[] for _ in range(self.n_buckets)]
        self._sealed: deque[int] = deque()
        self._free = list(range(self.n_buckets))
        self._open: int | None = None
        self.recycled = 0
        self.dropped = 0

    def bucket_path(self, b: int) -> str:
        return str(self.root / f"bucket_{b:05d}.bin")

    def has(self, key: str) -> bool:
        return key in self._where

    def _next_bucket(self) -> int | None:
        if self._free:
            return heapq.heappop(self._free)
        if not self._sealed:
            return None
        b = self._sealed.popleft()            # FIFO: the oldest bucket goes, whole
        for k in self._members[b]:
            if self._where.get(k, (None,))[0] == b:
                del self._where[k]
                self.dropped += 1
        self._members[b] = []
        self.recycled += 1
        return b

    def store(self, keys: Sequence[str]) -> tuple[int, int]:
        placed = []
        for k in keys:
            if k in self._where:
                continue
            if self._open is None or len(self._members[self._open]) >= self.bucket_blocks:
                if self._open is not None:
                    self._sealed.append(self._open)
                self._open = self._next_bucket()
                if self._open is None:
                    return self._write_runs(self.bucket_path, placed)   # no SSD at all
            b = self._open
            self._where[k] = (b, len(self._members[b]))
            self._members[b].append(k)
            placed.append(self._where[k])
        return self._write_runs(self.bucket_path, placed)

    def read(self, keys: Sequence[str], targets: Sequence[np.ndarray]) -> ReadJob:
        return self._read([(self.bucket_path(b), s) for b, s in (self._where[k] for k in keys)],
                          targets)
