"""The reclaimer: frees whole sessions while a medium is past its high watermark.

Which sessions go is ``tiers.reclaim.choose_victims`` (oldest unpinned leaves
first, down to the low watermark); this file measures each session's bytes on a
medium and drops the victims from the session table.  It holds the store core's lock
(``StoreCore.locked``) itself; a pinned session (a read or the writer holds it,
``StoreCore.pinned``) is never freed.
"""

from __future__ import annotations

import logging

from .address import Medium
from .tiers.reclaim import SessionUsage, choose_victims


log = logging.getLogger("sglang_flatcake")


class Reclaimer:
    """``listeners`` are called with the freed session ids after every reclaim or clear
    that freed any (outside the lock; the cluster sweeps its directory entries there)."""

    def __init__(self, core) -> None:      # the store's StoreCore (which makes its reclaimer)
        self.core = core
        self.listeners: list = []

    def _tell(self, freed: list[int]) -> None:
        for listener in list(self.listeners) if freed else ():
            listener(freed)

    def usage(self, medium: Medium) -> list[SessionUsage]:
        """Each session's bytes on ``medium``, with its pin, parent and live branches
        (the caller holds the core's lock)."""
        t = self.core.table
        bb = t.layout.block_bytes
        out = []
        for s in t.sessions.values():
            b = (len(s.memory_slots) * bb if medium == Medium.MEMORY
                 else t.ssd.file_bytes(s.sid))
            out.append(SessionUsage(s.sid, s.last_used, b, self.core.pinned(s),
                                    s.parent if s.parent in t.sessions else None,
                                    sum(1 for c in s.children if c in t.sessions)))
        return out

    def maybe_reclaim(self, ssd_extra: int = 0) -> list[int]:
        """Free whole sessions while a medium is (or, with ``ssd_extra`` more bytes,
        would be) past its high watermark; returns the freed ids (empty: nothing to do)."""
        freed: list[int] = []
        cfg, ssd, arena = self.core.config, self.core.ssd, self.core.arena
        ssd_cap = ssd.capacity_bytes
        ssd_hot = ssd.used_bytes + ssd_extra > cfg.high_watermark * ssd_cap
        mem_hot = arena.used_bytes > cfg.high_watermark * arena.capacity_bytes
        if not (ssd_hot or mem_hot):
            return freed            # the common case: nothing to look at
        with self.core.locked() as table:
            for medium, used, cap in ((Medium.SSD, ssd.used_bytes + ssd_extra, ssd_cap),
                                      (Medium.MEMORY, arena.used_bytes, arena.capacity_bytes)):
                victims = choose_victims(self.usage(medium), used, cap,
                                         cfg.high_watermark, cfg.low_watermark)
                for sid in victims:
                    table.drop(table.sessions[sid])
                    freed.append(sid)
        if freed:
            self.core.count("reclaimed_sessions", len(freed))
            log.info("flatcake: reclaimed %d sessions", len(freed))
            self._tell(freed)
        return freed

    def clear(self) -> int:
        """Free every session no reader holds, branches before parents; returns how many."""
        with self.core.locked() as table:
            victims = [s for s in table.sessions.values() if not self.core.pinned(s)]
            for s in sorted(victims, key=lambda s: -s.sid):
                table.drop(s)
        self._tell([s.sid for s in victims])
        return len(victims)
