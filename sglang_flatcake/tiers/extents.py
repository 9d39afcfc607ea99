"""Free space of the region: sorted, coalesced runs of free extents.

``ExtentAllocator(n)`` starts with extents ``[0, n)`` free.  ``take(count)`` hands out
one contiguous run (first fit) and ``take_at(start, count)`` a run at a given place;
both return None (a miss, nothing changed) when there is no such free run.  ``give``
returns a run; freeing an extent that is already free raises ``ValueError`` (a
double free is a bug, never papered over).
"""

from __future__ import annotations

import bisect


class ExtentAllocator:
    def __init__(self, n_extents: int) -> None:
        self.n_extents = n_extents
        self._starts: list[int] = [0] if n_extents else []
        self._counts: list[int] = [n_extents] if n_extents else []
        self.free_extents = n_extents

    def runs(self) -> list[tuple[int, int]]:
        """The free runs, (start, count), in address order."""
        return list(zip(self._starts, self._counts))

    def largest(self) -> int:
        return max(self._counts, default=0)

    def _cut(self, i: int, start: int, count: int) -> None:
        s, c = self._starts[i], self._counts[i]
        pieces = [(s, start - s), (start + count, s + c - start - count)]
        del self._starts[i], self._counts[i]
        for ps, pc in reversed(pieces):
            if pc:
                self._starts.insert(i, ps)
                self._counts.insert(i, pc)
        self.free_extents -= count

    def take(self, count: int) -> int | None:
        """Start of a free run of ``count`` extents (first fit), now taken; None if none."""
        for i, c in enumerate(self._counts):
            if c >= count:
                start = self._starts[i]
                self._cut(i, start, count)
                return start
        return None

    def take_at(self, start: int, count: int) -> bool:
        """Take ``[start, start+count)`` if all of it is free."""
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0 or start + count > self._starts[i] + self._counts[i] or count <= 0:
            return False
        self._cut(i, start, count)
        return True

    def give(self, start: int, count: int) -> None:
        """Free ``[start, start+count)``, merging with free neighbours."""
        if count <= 0 or start < 0 or start + count > self.n_extents:
            raise ValueError(f"give: run ({start}, {count}) outside [0, {self.n_extents})")
        i = bisect.bisect_right(self._starts, start)
        if (i > 0 and self._starts[i - 1] + self._counts[i - 1] > start) or \
                (i < len(self._starts) and self._starts[i] < start + count):
            raise ValueError(f"give: run ({start}, {count}) is already (partly) free")
        self._starts.insert(i, start)
        self._counts.insert(i, count)
        self.free_extents += count
        if i + 1 < len(self._starts) and start + count == self._starts[i + 1]:
            self._counts[i] += self._counts.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._counts[i - 1] == start:
            self._counts[i - 1] += self._counts.pop(i)
            self._starts.pop(i)
