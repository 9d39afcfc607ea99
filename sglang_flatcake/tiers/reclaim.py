"""Per-session reclaim: which sessions to free, whole, when a medium passes its high watermark.

A pure policy over session summaries.  Candidates are sessions that no reader
(or writer) holds and that no stored branch still builds on (a branch's prefix
lives in its parent); among them the least recently used goes first.  Freeing a
branch can make its parent a candidate in the same pass.  Sessions holding
nothing on the medium are never chosen (freeing them would not help).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(frozen=True)
class SessionUsage:
    sid: int
    last_used: float
    bytes: int          # bytes this session holds on the medium being reclaimed
    pinned: bool
    parent: int | None
    children: int       # number of stored branches of this session


def choose_victims(sessions: list[SessionUsage], used: int, capacity: int,
                   high: float, low: float) -> list[int]:
    """Sessions to free, in order, so that ``used`` drops under ``low * capacity``.

    Returns ``[]`` when ``used <= high * capacity``.  May return fewer than
    needed when every remaining session is pinned or has branches.
    """
    if capacity <= 0 or used <= high * capacity:
        return []
    target = low * capacity
    by_id = {s.sid: s for s in sessions}
    children = {s.sid: s.children for s in sessions}
    heap = [(s.last_used, s.sid) for s in sessions
            if not s.pinned and s.children == 0 and s.bytes > 0]
    heapq.heapify(heap)
    out: list[int] = []
    while used > target and heap:
        _, sid = heapq.heappop(heap)
        s = by_id[sid]
        out.append(sid)
        used -= s.bytes
        p = s.parent
        if p is not None and p in by_id:
            children[p] -= 1
            ps = by_id[p]
            if children[p] == 0 and not ps.pinned and ps.bytes > 0:
                heapq.heappush(heap, (ps.last_used, p))
    return out
