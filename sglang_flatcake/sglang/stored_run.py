"""The leading run of keys a rank's store holds, and which are on SSD: what both modes' lookups
(``hicache.direct``, ``linker.lookup``) restore and their writes skip (``write_once``,
``linker.offload``: a stored page is not written again).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import address as addr


@dataclass(frozen=True)
class StoredRun:
    """``pages`` leading keys stored; ``ssd`` the indices of those on SSD, ascending."""

    pages: int
    ssd: tuple[int, ...] = ()

    @property
    def lead_memory(self) -> int:
        """Pages of the run before its first SSD page."""
        return self.ssd[0] if self.ssd else self.pages


def stored_run(store, keys: list[str], damaged=frozenset()) -> StoredRun:
    """The leading run of ``keys`` in ``store``, stopped before a key in ``damaged``."""
    where = store.locate(keys) if keys else []
    n = next((i for i, (k, a) in enumerate(zip(keys, where)) if a is None or k in damaged),
             len(where))
    return StoredRun(n, tuple(i for i, a in enumerate(where[:n]) if a.medium == addr.Medium.SSD))
