"""``lookup`` in linker mode: how much of a request's uncached tail to restore.

The restorable run is the leading run of the tail's keys the store holds (one index probe
per page), stopped before any key whose checksum failed in this process
(``LayerLoader.damaged``).  When the run has SSD pages, ``sched.recompute`` decides (the
same ``RestoreOrRecompute`` as HiCache mode): the SSD part is restored only while that
ends no later than recomputing it, the disk backlog being the SSD bytes of the loads
queued or running in this linker.  Otherwise the run is cut before its first SSD page
(memory pages are still restored).

Rates: restores measure themselves (``LayerLoader``; before any, the disk probe); the
prefill rate is timed per scheduler step (``prefill.PrefillClock``: the tokens a step
launched over that step's seconds, so per-step overhead counts too), and a request's own
tokens are priced at the margin once the steps tell it (``sched.rates.Marginal``: what a
new token adds to a step at a fixed context).  Until a rate is known the decision restores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...sched.rates import Cost, Marginal, Rate
from ...sched.recompute import RestoreOrRecompute
from ..stored_run import stored_run


@dataclass(frozen=True)
class Found:
    """``pages`` to restore of ``tail`` pages; ``ssd_pages`` of them on SSD."""

    pages: int
    tail: int
    ssd_pages: int
    cut: bool                        # the run was cut before its first SSD page
    choice: Any = None               # the ``sched.recompute.Choice`` when it had SSD pages


class Lookup:
    def __init__(self, store, damaged: set, enabled: bool, probe: Any = None) -> None:
        self.store, self.damaged = store, damaged
        self.decider = RestoreOrRecompute(Cost(), Rate(), enabled,   # as HiCache mode prices it
                                          marginal=Marginal())
        self.probe = probe           # ``probe.DiskProbe``: prices restores before any load ran

    def find(self, keys: list[str], disk_backlog_bytes: float, disk_backlog_restores: int = 0,
             gpu_backlog_tokens: float = 0.0) -> Found:
        """The restorable run of ``keys`` (counts one decision when it has SSD pages), behind
        ``disk_backlog_restores`` restores of ``disk_backlog_bytes`` and ``gpu_backlog_tokens``
        prefill tokens (the backlog as it is when the request joins)."""
        run = stored_run(self.store, keys, self.damaged)
        n, ssd = run.pages, run.ssd
        if not ssd:
            return Found(n, len(keys), 0, False)
        page, bb = self.store.layout.page_tokens, self.store.layout.block_bytes
        d, tokens = self.decider, (n - ssd[0]) * page
        if self.probe is not None and d.enabled:
            self.probe.collect(d.restore)
            self.probe.want(d.restore, [keys[i] for i in ssd])
        choice = d.estimate(len(ssd) * bb, tokens, disk_backlog_bytes, gpu_backlog_tokens,
                            disk_backlog_restores)
        d.count(choice.restore, tokens, len(ssd) * bb)
        if choice.restore:
            return Found(n, len(keys), len(ssd), False, choice)
        return Found(ssd[0], len(keys), 0, True, choice)

    def stats(self) -> dict:
        return self.decider.stats()
