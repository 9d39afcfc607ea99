"""Restore or recompute: at admission, is a request's SSD part worth reading?

Restoring a token costs ``kv_bytes_per_token / restore rate`` of disk time;
recomputing it costs ``1 / prefill rate`` of GPU time.  When the disk is the
slower of the two (DeepSeek-V3 on one local disk: 54.5 us against 16.7 us a
token) every restore makes the disk queue longer while the GPU idles.  So, when
a request with SSD blocks arrives, ``RestoreOrRecompute.choose`` compares::

    restore_s   = (disk backlog bytes + its SSD bytes) / restore bytes per s
    recompute_s = (GPU backlog tokens + the tokens it would recompute) / prefill tokens per s

and restores only while ``restore_s + ssd_bytes / restore rate <= recompute_s +
tokens / prefill rate``: each choice is charged once more with its own service
time, the delay it adds to the next request queued on that resource (without it,
a recompute that saved its own request 0.1 s cost the requests behind it on the
GPU 0.4 s; replay, DeepSeek-V4-Flash at 0.5 req/s).  ``restore_s`` is times the
``slip``: how much longer the restores it chose took than that formula said
(moving sums of measured over modelled seconds, from 1), since what comes after a
decision (writes and later restores sharing the disk, restores that overtake it)
is not in the backlog.  Either way the request
prefills the rest of its prompt afterwards, and a restored request's prefill
waits for the GPU backlog as well, so this compares its expected first-token
times.  Where restores start only at the head of one first-come first-served
queue (``single_queue``, head-only) the request waits for everything ahead of it
either way, so callers pass both backlogs as 0 and its own times are compared.
When it recomputes, its SSD part is a miss: the blocks before the first
SSD block (memory hits) are still served, the run from the first SSD block on is
recomputed, nothing is read from the SSD and nothing wrong is served.

The rates are ``Rate`` moving sums of measured work (the server: its restores and
prefill steps; the replay: its restores, from the disk model's bandwidth, and the
GPU preset's prefill rate).  While a rate is unknown the decision restores (what
was done before it existed); a measured rate counts as known for a request only once
it has measured at least half that request's amount (``Rate.value_for``).  ``Backlog`` (``rates``) is the work queued or in
flight on one resource.  Everything is plain arithmetic over the values passed
in: with TP ranks, callers agree on the answer, not the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .rates import Backlog, Rate

__all__ = ["Backlog", "Choice", "Rate", "RestoreOrRecompute"]


@dataclass(frozen=True)
class Choice:
    restore: bool
    restore_s: float | None      # expected seconds to its restore's end (None: a rate unknown)
    recompute_s: float | None    # expected seconds to the end of recomputing those tokens
    modelled_s: float | None = None   # restore_s before the slip: what ``restored`` compares


@dataclass
class RestoreOrRecompute:
    """The decision and its counters; ``enabled=False`` always restores and counts nothing."""

    restore: Rate                # SSD bytes per second, all restores together
    prefill: Rate                # prefill tokens per second
    enabled: bool = True
    # restores' measured seconds (decision to end) per modelled second: what the backlog
    # cannot know (writes and restores that come later and share the disk, overtaking)
    slip: Rate = field(default_factory=lambda: Rate(1.0))
    counts: dict = field(default_factory=lambda: {
        "restored_requests": 0, "recomputed_requests": 0, "recomputed_tokens": 0,
        "ssd_bytes_not_read": 0, "reconsidered_requests": 0})

    def estimate(self, ssd_bytes: float, tokens: int, disk_backlog_bytes: float,
                 gpu_backlog_tokens: float) -> Choice:
        """The comparison for one request, counting nothing."""
        r, p = self.restore.value_for(ssd_bytes), self.prefill.value_for(tokens)
        if not self.enabled or ssd_bytes <= 0 or tokens <= 0 or r is None or p is None:
            return Choice(True, None, None)
        modelled = (max(0.0, disk_backlog_bytes) + ssd_bytes) / r
        restore_s = modelled * self.slip.value
        recompute_s = (max(0.0, gpu_backlog_tokens) + tokens) / p
        # each choice also delays the next request on its resource by its own service time
        restore = restore_s + ssd_bytes / r <= recompute_s + tokens / p
        return Choice(restore, restore_s, recompute_s, modelled)

    def restored(self, choice: Choice, took_s: float) -> None:
        """A restore this decision chose ended ``took_s`` after the decision: the slip
        learns from it (a no-op for a choice made without rates)."""
        if choice.modelled_s is not None:
            self.slip.observe(took_s, choice.modelled_s)

    def choose(self, ssd_bytes: float, tokens: int, disk_backlog_bytes: float,
               gpu_backlog_tokens: float) -> Choice:
        """``estimate`` for a request that arrived with ``ssd_bytes`` on SSD, whose SSD part
        is ``tokens`` tokens (from its first SSD block to the end of its stored run); counted."""
        c = self.estimate(ssd_bytes, tokens, disk_backlog_bytes, gpu_backlog_tokens)
        self.count(c.restore, tokens, ssd_bytes)
        return c

    def count(self, restored: bool, tokens: int, ssd_bytes: float) -> None:
        """Count one decision (callers that agree on it across ranks count the agreed one)."""
        if not self.enabled or ssd_bytes <= 0:
            return
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
                "restore_bytes_per_s": self.restore.value, "prefill_tokens_per_s":
                self.prefill.value, "restore_samples": self.restore.samples,
                "prefill_samples": self.prefill.samples, "restore_slip": self.slip.value,
                **self.counts}
