"""Sessions: the lineage of a hash chain, and the segments and memory blocks it owns.

A write whose prefix ends at a session's last block continues that session
(appends a segment); a write whose prefix ends in the middle of a stored chain
starts a new session whose ``parent`` and ``parent_blocks`` point at the
branch point, so the shared prefix is referred to, never copied.  Memory-placed
blocks belong to the session too, so reclaim frees a session whole.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from .layout import SegmentGeometry


@dataclass
class Segment:
    """One committed write batch of a session on SSD."""

    offset: int                  # file offset of the segment (its header)
    geometry: SegmentGeometry
    digests: np.ndarray          # (n, 2) uint64 keys, in chain order
    checksums: np.ndarray        # (layers, n) uint64
    seq: int
    turn: int
    first_pos: int               # lineage position of block 0

    @property
    def n_blocks(self) -> int:
        return self.geometry.n_blocks

    @property
    def end(self) -> int:
        return self.offset + self.geometry.total_bytes


@dataclass
class Session:
    sid: int
    parent: int | None
    parent_blocks: int           # lineage blocks before this session's first block
    created: float
    last_used: float
    label: str = ""
    segments: list[Segment] = field(default_factory=list)
    seg_starts: list[int] = field(default_factory=list)
    memory_slots: list[int] = field(default_factory=list)
    memory_digests: list[np.ndarray] = field(default_factory=list)
    memory_pos: dict[int, int] = field(default_factory=dict)   # slot -> lineage position
    n_blocks: int = 0            # own blocks (SSD and memory)
    tail: tuple[int, int] | None = None  # digest of the last own block
    write_offset: int = 0        # where the next segment goes in the file
    readers: int = 0             # pins held by reads and the writer: StoreCore.pin/unpin only
    children: set[int] = field(default_factory=set)
    next_seq: int = 0
    durable: bool = False        # manifest written
    writes: int = 0              # write batches stored in this session
    last_write_blocks: int = 0   # blocks of the latest write batch
    last_reply_blocks: int = 0   # blocks of the latest odd-numbered write (a reply, write-through)

    @property
    def lineage_end(self) -> int:
        return self.parent_blocks + self.n_blocks

    def record_write(self, n_blocks: int, tail, when: float) -> None:
        """Count one stored write batch of ``n_blocks`` ending with the block whose digest
        is ``tail`` (odd-numbered batches are replies), used at ``when`` or later.  The
        writer and both media's recovery call it, so a restart keeps the same counts."""
        if self.writes % 2 == 1:
            self.last_reply_blocks = n_blocks
        self.writes += 1
        self.last_write_blocks = n_blocks
        self.n_blocks += n_blocks
        self.tail = (int(tail[0]), int(tail[1]))
        self.last_used = max(self.last_used, when)

    def add_segment(self, seg: Segment) -> None:
        self.segments.append(seg)
        self.seg_starts.append(seg.offset)
        self.write_offset = max(self.write_offset, seg.end)
        self.next_seq = max(self.next_seq, seg.seq + 1)

    def segment_at(self, file_offset: int) -> Segment:
        """The segment whose data holds ``file_offset``."""
        i = bisect.bisect_right(self.seg_starts, file_offset) - 1
        if i < 0:
            raise KeyError(f"session {self.sid}: no segment at offset {file_offset}")
        return self.segments[i]

    def ssd_bytes(self) -> int:
        return sum(s.geometry.total_bytes for s in self.segments)

    def all_digests(self) -> np.ndarray:
        parts = [s.digests for s in self.segments] + self.memory_digests
        return np.concatenate(parts) if parts else np.empty((0, 2), np.uint64)
