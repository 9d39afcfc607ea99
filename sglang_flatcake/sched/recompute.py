"""Restore or recompute: at admission, is a request's SSD part worth reading?

A restore costs a fixed latency plus its bytes over the disk's bandwidth
(``rates.Cost``, fitted from the restores measured: a rate measured from small
restores is latency, not bandwidth); recomputing costs its tokens over the
prefill rate, behind the prefill tokens it joins.  So, when a request with SSD
blocks arrives, ``RestoreOrRecompute.choose`` compares::

    restore_s   = (restores ahead + its own) x latency + (bytes ahead + its own) / bandwidth
    recompute_s = (GPU backlog tokens + the tokens it would recompute) / prefill tokens per s

where the GPU backlog is the prefill work queued when it joins (the tokens it
would wait behind).  Its own tokens are priced at the margin where a ``Marginal`` is
given and has a price (``rates.Marginal``: what a step adds per new token at a fixed
context, at most the average): restored or not, they are context for the rest of the
prompt, so recomputing them costs only what computing them adds.  Each side is charged
once more with its own service time, the delay it adds to the next request queued on
that resource (without it, a
recompute that saved its own request 0.1 s cost the requests behind it on the GPU
0.4 s; replay, DeepSeek-V4-Flash at 0.5 req/s).  ``restore_s`` is times the
``slip`` (how much longer the restores it chose took than that formula said,
moving sums of measured over modelled seconds, from 1, at most ``SLIP_MAX``): what
comes after a decision (writes and later restores sharing the disk, restores that
overtake it) is not in the backlog.  Either way the request prefills the rest of
its prompt afterwards, and a restored request's prefill waits for the GPU backlog
as well, so this compares its expected first-token times.  Where restores start
only at the head of one first-come first-served queue (``single_queue``,
head-only) the request waits for everything ahead of it either way, so callers
pass both backlogs as 0 and its own times are compared.

No flapping: once the last agreed decision was to restore, it takes a restore
costing more than ``1 + MARGIN`` times the recompute to recompute; once it was to
recompute, restoring wins again as soon as it costs no more.  Within that band the
last decision stands, so noise in the measurements does not make requests of one
size alternate; the band leans towards restoring because a wrong restore is
measured and corrected, a wrong recompute is not (nothing is read, nothing measured).

When it recomputes, its SSD part is a miss: the blocks before the first SSD block
(memory hits) are still served, the run from the first SSD block on is
recomputed, nothing is read from the SSD and nothing wrong is served.

While a price is unknown the decision restores (what was done before it existed):
a ``Cost`` prices nothing before ``rates.MIN_SAMPLES`` restores, a measured prefill
``Rate`` nothing until it has measured half the tokens it would time
(``Rate.value_for``).  ``Backlog`` (``rates``) is the work queued or in flight on
one resource.  Everything is plain arithmetic over the values passed in: with TP
ranks, callers agree on the answer (MIN of "restore"), not the inputs, and count
the agreed answer (``count``), which is what the band remembers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .rates import Backlog, Cost, Marginal, Rate

__all__ = ["Backlog", "Choice", "Cost", "Marginal", "Rate", "RestoreOrRecompute"]

MARGIN = 0.15       # restoring must cost this much more than recomputing to stop restoring
SLIP_MAX = 2.0      # the slip at most doubles a restore's price (one slow restore is not a trend)


@dataclass(frozen=True)
class Choice:
    restore: bool
    restore_s: float | None      # expected seconds to its restore's end (None: a price unknown)
    recompute_s: float | None    # expected seconds to the end of recomputing those tokens
    modelled_s: float | None = None   # restore_s before the slip: what ``restored`` compares


@dataclass
class RestoreOrRecompute:
    """The decision and its counters; ``enabled=False`` always restores and counts nothing."""

    restore: Cost | Rate         # seconds per restore and per SSD byte (``Cost``; a ``Rate``:
                                 # bytes per second and no latency)
    prefill: Rate                # prefill tokens per second
    enabled: bool = True
    restoring: bool = True       # the last agreed decision (the band's memory, ``count``)
    # restores' measured seconds (decision to end) per modelled second: what the backlog
    # cannot know (writes and restores that come later and share the disk, overtaking)
    slip: Rate = field(default_factory=lambda: Rate(1.0))
    # seconds a step adds per new token at a fixed context (None: the average prices them)
    marginal: Marginal | None = None
    counts: dict = field(default_factory=lambda: {
        "restored_requests": 0, "recomputed_requests": 0, "recomputed_tokens": 0,
        "ssd_bytes_not_read": 0, "reconsidered_requests": 0})

    def estimate(self, ssd_bytes: float, tokens: int, disk_backlog_bytes: float,
                 gpu_backlog_tokens: float, disk_backlog_restores: int = 0) -> Choice:
        """The comparison for one request (``ssd_bytes`` to read, ``tokens`` to recompute
        instead) behind ``disk_backlog_restores`` restores of ``disk_backlog_bytes`` and
        ``gpu_backlog_tokens`` prefill tokens; counts nothing, changes nothing."""
        own = self.restore.seconds_for(ssd_bytes)
        p = self.prefill.value_for(tokens)
        if not self.enabled or ssd_bytes <= 0 or tokens <= 0 or own is None or p is None:
            return Choice(True, None, None)
        modelled = self.restore.seconds_for(max(0.0, disk_backlog_bytes) + ssd_bytes,
                                            max(0, disk_backlog_restores) + 1)
        if modelled is None:             # a plain Rate not trusted for the backlog's size
            return Choice(True, None, None)
        restore_s = modelled * min(SLIP_MAX, self.slip.value)
        mine = tokens * self.per_token(p)
        recompute_s = max(0.0, gpu_backlog_tokens) / p + mine
        # each choice also delays the next request on its resource by its own service time
        cost, other = restore_s + own, recompute_s + mine
        restore = cost <= other * (1.0 + MARGIN if self.restoring else 1.0)
        return Choice(restore, restore_s, recompute_s, modelled)

    def per_token(self, rate: float) -> float:
        """Seconds recomputing one of a request's own tokens costs: the marginal price when
        there is one, at most the average ``1 / rate``."""
        m = None if self.marginal is None else self.marginal.per_token()
        return 1.0 / rate if m is None else min(m, 1.0 / rate)

    def restored(self, choice: Choice, took_s: float) -> None:
        """A restore this decision chose ended ``took_s`` after the decision: the slip
        learns from it (a no-op for a choice made without rates)."""
        if choice.modelled_s is not None:
            self.slip.observe(took_s, choice.modelled_s)

    def choose(self, ssd_bytes: float, tokens: int, disk_backlog_bytes: float,
               gpu_backlog_tokens: float, disk_backlog_restores: int = 0) -> Choice:
        """``estimate`` for a request that arrived with ``ssd_bytes`` on SSD, whose SSD part
        is ``tokens`` tokens (from its first SSD block to the end of its stored run); counted
        (one rank; ranks that agree call ``estimate`` and ``count`` the agreed answer)."""
        c = self.estimate(ssd_bytes, tokens, disk_backlog_bytes, gpu_backlog_tokens,
                          disk_backlog_restores)
        self.count(c.restore, tokens, ssd_bytes)
        return c

    def count(self, restored: bool, tokens: int, ssd_bytes: float) -> None:
        """Count one decision (callers that agree on it across ranks count the agreed one)."""
        if not self.enabled or ssd_bytes <= 0:
            return
        self.restoring = bool(restored)
        if restored:
            self.counts["restored_requests"] += 1
        else:
            self.counts["recomputed_requests"] += 1
            self.counts["recomputed_tokens"] += int(tokens)
            self.counts["ssd_bytes_not_read"] += int(ssd_bytes)

    def reconsidered(self, tokens: int, ssd_bytes: float) -> None:
        """A restore counted as restored is recomputed after all (checked again when its
        restore would start, the queues having moved)."""
        if self.enabled and ssd_bytes > 0:
            self.counts["restored_requests"] -= 1
            self.counts["reconsidered_requests"] += 1
            self.count(False, tokens, ssd_bytes)

    def stats(self) -> dict:
        """The estimates it decides with, and its counts (for stats and the replay's JSON)."""
        return {"recompute_when_faster": self.enabled,
                "restore_bytes_per_s": self.restore.value,
                "restore_latency_s": self.restore.latency, "prefill_tokens_per_s":
                self.prefill.value, "restore_samples": self.restore.samples,
                "prefill_samples": self.prefill.samples, "restore_slip": self.slip.value,
                "prefill_marginal_s_per_token": None if self.marginal is None
                else self.marginal.per_token(),
                "prefill_marginal_samples": 0 if self.marginal is None
                else self.marginal.samples,
                **self.counts}
