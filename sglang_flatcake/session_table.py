"""The session table: which sessions exist, how they descend, where their blocks sit.

One ``SessionTable`` per store.  It owns ``sessions`` (id -> ``Session``), the client
label map and the next session id, and it is the only code that adds a session's
blocks to the key index or takes them out.  The store core (``store_core.StoreCore``)
owns it: every method is called under ``StoreCore.locked()``; none does I/O except
``drop``, which asks the SSD tier to release the session's space (a metadata operation
on both media).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from . import address as addr
from .address import Medium
from .sessions import Segment, Session


@dataclass(frozen=True)
class Lineage:
    session: int
    writes: int                  # write batches in the lineage (this session and its parents)
    last_write_blocks: int       # blocks of the session's latest write batch
    last_reply_blocks: int       # blocks of its latest odd-numbered write (a reply, write-through)
    position: int                # blocks of the chain up to and including the key
    at_tail: bool                # the key is the session's last block


class SessionTable:
    """Sessions, their lineage and the index entries of their blocks."""

    def __init__(self, index, arena, ssd, layout, node_id: int) -> None:
        self.index, self.arena, self.ssd = index, arena, ssd
        self.layout, self.node_id = layout, node_id
        self.sessions: dict[int, Session] = {}
        self.by_label: dict[str, int] = {}     # client session id -> its latest session
        self.next_sid = 1

    # -- lineage ----------------------------------------------------------------------
    def session_for(self, anchor: np.ndarray | None, label: str) -> Session:
        """The session a write after block ``anchor`` belongs to: the one whose tail it is,
        else a new branch of the session holding it, else (a ``label`` the table knows and
        an anchor not stored here) the label's session, else a new root.  Adds a new
        session to the table."""
        parent, parent_blocks = None, 0
        found = False
        if anchor is not None:
            a, ok = self.index.lookup_digests(np.asarray(anchor, np.uint64).reshape(1, 2))
            if ok[0]:
                found = True
                owner, pos = self.owner_and_position(int(a[0]))
                s = self.sessions.get(owner)
                if s is not None and s.tail == (int(anchor[0]), int(anchor[1])):
                    return s
                if s is not None:
                    parent, parent_blocks = s.sid, pos + 1
        if label and not found and label in self.by_label:
            # the client names the session but its chain's prefix is not stored here (never
            # written, or lost with memory): keep the client's session in its own file
            s = self.sessions.get(self.by_label[label])
            if s is not None:
                return s
        now = time.time()
        s = Session(self.next_sid, parent, parent_blocks, now, now, label)
        self.next_sid += 1
        self.add(s)
        if parent is not None:
            self.sessions[parent].children.add(s.sid)
        return s

    def add(self, s: Session) -> None:
        """Enter ``s`` (new, or recovered) under its id and label."""
        self.sessions[s.sid] = s
        if s.label:
            self.by_label[s.label] = s.sid

    def owner_and_position(self, a: int) -> tuple[int, int]:
        """(session, lineage position) of the block at address ``a``; ``KeyError`` when no
        session holds it."""
        d = addr.decode(a)
        if d.medium == Medium.MEMORY:
            slot = self.arena.slot_of(d.offset)
            sid = int(self.arena.owner[slot])
            s = self.sessions[sid]
            return sid, s.parent_blocks + s.memory_pos[slot]
        sid, foff = self.ssd.locate(d.offset)
        s = self.sessions[sid]
        seg = s.segment_at(foff)
        idx = (foff - seg.offset - seg.geometry.header_bytes) // self.layout.block_layer_bytes
        return sid, seg.first_pos + idx

    def lineage(self, dig: np.ndarray) -> Lineage | None:
        """What the table knows of the session holding the key digest ``dig`` (1, 2)."""
        a, ok = self.index.lookup_digests(dig)
        if not ok[0]:
            return None
        sid, pos = self.owner_and_position(int(a[0]))
        s = self.sessions[sid]
        writes, p = s.writes, self.sessions.get(s.parent) if s.parent is not None else None
        seen = {sid}
        while p is not None and p.sid not in seen:   # earlier turns live in the parents
            seen.add(p.sid)
            writes += p.writes
            p = self.sessions.get(p.parent) if p.parent is not None else None
        return Lineage(sid, writes, s.last_write_blocks, s.last_reply_blocks, pos + 1,
                       s.tail == (int(dig[0, 0]), int(dig[0, 1])))

    # -- index entries ----------------------------------------------------------------
    def index_segment(self, s: Session, seg: Segment) -> None:
        """Point the index at every block of ``seg``, a segment of ``s`` on the SSD."""
        blb = self.layout.block_layer_bytes
        base = seg.offset + seg.geometry.header_bytes
        addrs = np.array([addr.encode(Medium.SSD, self.node_id,
                                      self.ssd.address(s.sid, base + i * blb))
                          for i in range(seg.n_blocks)], dtype=np.uint64)
        self.index.put_digests(seg.digests, addrs)

    def index_memory(self, s: Session, dig: np.ndarray, slots: list[int],
                     positions: list[int]) -> None:
        """Give ``s`` the arena ``slots`` (already filled) holding the blocks ``dig`` at
        lineage ``positions``, and point the index there."""
        for slot, pos in zip(slots, positions):
            s.memory_pos[slot] = pos
        s.memory_slots.extend(slots)
        s.memory_digests.append(dig)
        bb = self.layout.block_bytes
        self.index.put_digests(dig, np.array(
            [addr.encode(Medium.MEMORY, self.node_id, slot * bb) for slot in slots],
            dtype=np.uint64))

    # -- removal ----------------------------------------------------------------------
    def drop(self, s: Session) -> None:
        """Remove a session's keys, memory slots and SSD space; a no-op for its lineage
        beyond unlinking it from its parent (its branches keep their own blocks)."""
        digs = s.all_digests()
        if len(digs):
            self.index.remove_digests(digs)
        if s.memory_slots:
            self.arena.free(s.memory_slots)
        self.sessions.pop(s.sid, None)
        if s.label and self.by_label.get(s.label) == s.sid:
            del self.by_label[s.label]
        if s.parent in self.sessions:
            self.sessions[s.parent].children.discard(s.sid)
        self.ssd.release(s.sid)
