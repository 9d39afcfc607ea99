"""Measured throughput and queued work: ``Rate``, ``Cost`` and ``Backlog`` (for ``recompute``
and ``queues``).

Plain arithmetic over an injected notion of time: callers pass ``now`` and the
measured seconds, so the same classes serve the server (its monotonic clock) and
the replay (virtual time).
"""

from __future__ import annotations

from collections import deque
from statistics import median
from typing import Hashable

import numpy as np

MEMORY = 0.8        # weight of the past in a moving sum (``queues`` uses it for its restore rate)


TRUST = 0.5         # a measured rate speaks for amounts up to 1 / TRUST times what it has seen


class Rate:
    """Units per second as moving sums of measurements: ``observe(amount, seconds)`` weighs the
    sums so far by ``MEMORY``.  ``first`` (a rate the caller knows, e.g. a model's) counts as one
    second of measurement and is trusted for any amount (None: no value until the first
    measurement)."""

    def __init__(self, first: float | None = None) -> None:
        if first is not None and not first > 0:
            raise ValueError(f"first={first!r} is not allowed: expected a rate > 0 or None")
        self._sums = [float(first), 1.0] if first is not None else [0.0, 0.0]
        self.known = first is not None
        self.samples = 0

    def value_for(self, amount: float) -> float | None:
        """``value`` when it may be used to time ``amount``: a rate given at construction
        always; a measured one only once the amounts it has seen (moving sum) reach
        ``TRUST * amount``, since a few small measurements are mostly fixed latency (seen: one
        8 KiB restore in 0.2 s, the first over a new connection, priced a 0.3 MiB restore at
        7 s).  None: not known for that amount."""
        if self.known or self._sums[0] >= TRUST * amount:
            return self.value
        return None

    def observe(self, amount: float, seconds: float) -> None:
        """Add one measurement; ignored unless both ``amount`` and ``seconds`` are > 0."""
        if amount <= 0 or seconds <= 0:
            return
        self._sums = [MEMORY * self._sums[0] + amount, MEMORY * self._sums[1] + seconds]
        self.samples += 1

    def seconds_for(self, amount: float, count: int = 1) -> float | None:
        """Seconds to serve ``amount`` at ``value_for(amount)`` (``count`` is ignored: a plain
        rate has no fixed cost per item); None where that is None."""
        v = self.value_for(amount)
        return None if v is None else max(0.0, amount) / v

    @property
    def value(self) -> float | None:
        return self._sums[0] / self._sums[1] if self._sums[1] > 0 else None

    @property
    def latency(self) -> float | None:
        """0 once known (a plain rate has no fixed cost); None while ``value`` is."""
        return None if self.value is None else 0.0


WINDOW = 32             # ``Cost`` fits the last this many measurements
MIN_SAMPLES = 3         # ... and prices nothing from fewer (one slow first restore decides nothing)
SPREAD = 1.5            # two measurements whose amounts differ by this factor give a slope
BANDWIDTH_PRIOR = 1e9   # bytes/s assumed while the amounts measured are all alike (see ``Cost``)
BANDWIDTH_MAX = 1e12    # bytes/s: a fitted slope is never flatter than this


class Cost:
    """Seconds an item of ``amount`` takes as ``latency + amount / bandwidth`` (e.g. one
    restore: a fixed cost per restore, then its bytes at the disk's rate).

    Given (``bandwidth``, optionally ``latency``): a model the caller knows, used as is and
    never refitted (the replay's disk model).  Otherwise both are fitted from the last
    ``WINDOW`` ``observe``d (amount, seconds) pairs, robustly (Theil-Sen): the slope
    (seconds per unit) is the median of the slopes between pairs of measurements whose
    amounts differ by ``SPREAD`` or more, plus one vote for ``1 / bandwidth_prior``; the
    latency is the median of ``seconds - slope * amount``, within [0, median seconds].  While
    every amount measured is alike, the prior alone sets the slope, so those measurements are
    read as latency: an error that, if wrong, prices restores of other sizes low, which makes
    the decision restore and so measure them, where pricing them high would make it recompute
    and never measure again (seen: 0.78 s for 0.5 MiB under load, read as 0.67 MB/s, priced
    0.1-0.2 MiB restores behind 1.7 MiB of others at 3 s and recomputed them).  Nothing is
    priced before ``MIN_SAMPLES`` measurements, and medians keep one outlier from moving it.
    """

    def __init__(self, bandwidth: float | None = None, latency: float = 0.0,
                 bandwidth_prior: float = BANDWIDTH_PRIOR) -> None:
        if bandwidth is not None and not bandwidth > 0:
            raise ValueError(f"bandwidth={bandwidth!r} is not allowed: expected a rate > 0 "
                             "or None")
        if not latency >= 0:
            raise ValueError(f"latency={latency!r} is not allowed: expected seconds >= 0")
        if not bandwidth_prior > 0:
            raise ValueError(f"bandwidth_prior={bandwidth_prior!r} is not allowed: "
                             "expected a rate > 0")
        self.known = bandwidth is not None
        self._prior_slope = 1.0 / bandwidth_prior
        self._fit = (float(latency), 1.0 / bandwidth) if self.known else None
        self._recent: deque = deque(maxlen=WINDOW)
        self.samples = 0

    def observe(self, amount: float, seconds: float) -> None:
        """Add one measurement; ignored unless both are > 0, and by a given model."""
        if amount <= 0 or seconds <= 0 or self.known:
            return
        self._recent.append((float(amount), float(seconds)))
        self.samples += 1
        if len(self._recent) >= MIN_SAMPLES:
            self._fit = self._refit()

    def _refit(self) -> tuple[float, float]:
        pts = list(self._recent)
        slopes = [self._prior_slope]
        for i, (a1, s1) in enumerate(pts):
            for a2, s2 in pts[i + 1:]:
                lo, hi = min(a1, a2), max(a1, a2)
                if hi >= SPREAD * lo:
                    slopes.append((s2 - s1) / (a2 - a1))
        slope = max(1.0 / BANDWIDTH_MAX, median(slopes))
        secs = median(s for _, s in pts)
        latency = min(secs, max(0.0, median(s - slope * a for a, s in pts)))
        return latency, slope

    def seconds_for(self, amount: float, count: int = 1) -> float | None:
        """Seconds for ``count`` items of ``amount`` in all: ``count * latency + amount /
        bandwidth``; None until fitted."""
        if self._fit is None:
            return None
        latency, slope = self._fit
        return max(0, count) * latency + max(0.0, amount) * slope

    @property
    def latency(self) -> float | None:
        """Fixed seconds per item (None until fitted)."""
        return None if self._fit is None else self._fit[0]

    @property
    def value(self) -> float | None:
        """Units per second past the latency, the bandwidth (None until fitted)."""
        return None if self._fit is None else 1.0 / self._fit[1]


FIT_WINDOW = 64        # ``Marginal`` fits the last this many steps
FIT_MIN = 8            # ... and prices nothing from fewer
FIT_SPREAD = 0.25      # ... nor until new / context tokens varies by this much between steps


class Marginal:
    """Seconds a prefill step adds per new token at a fixed context: what recomputing a
    stored run costs beyond restoring it, since the restored tokens are context either way.

    Step seconds are fitted as ``a + b * new + c * context`` (least squares over the last
    ``FIT_WINDOW`` steps, refitted once without the steps whose residual is over 3 median
    absolute residuals: one garbage-collection pause moves nothing); ``b`` plus two of its
    standard errors is the price (noisy steps price a new token dearer, not at zero).  An
    average rate (tokens over step seconds) charges a new token for the context it sees too:
    on SGLang's CPU attention a step's time follows its whole context, so the average
    priced recomputing 700 tokens at 126 ms where the step grew by about 7 ms, and restores
    3x dearer than recomputing were made.  No price (None) from fewer than ``FIT_MIN`` steps,
    or while new / context hardly varies (all first turns, or all cache hits: the fit could
    not tell the two apart); callers then use their average."""

    def __init__(self, window: int = FIT_WINDOW) -> None:
        self._pts: deque = deque(maxlen=window)
        self._fit: float | None = None
        self._stale = False
        self.samples = 0

    def observe(self, new: float, context: float, seconds: float) -> None:
        """One prefill step: ``new`` tokens computed among ``context`` (theirs and the cached
        prefixes they attend to; at least ``new``) in ``seconds``; ignored unless both > 0."""
        if new <= 0 or seconds <= 0:
            return
        self._pts.append((float(new), float(max(context, new)), float(seconds)))
        self._stale = True
        self.samples += 1

    def per_token(self) -> float | None:
        """The price, seconds per new token: ``b`` (at least 0) plus two of its standard
        errors; None while it cannot be told apart."""
        if self._stale:
            self._stale, self._fit = False, self._refit()
        return self._fit

    def _refit(self) -> float | None:
        if len(self._pts) < FIT_MIN:
            return None
        a = np.array(self._pts)
        share = a[:, 0] / a[:, 1]
        if share.max() - share.min() < FIT_SPREAD:
            return None
        x, y = np.column_stack([np.ones(len(a)), a[:, 0], a[:, 1]]), a[:, 2]
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
        res = np.abs(y - x @ coef)
        keep = res <= 3 * max(float(np.median(res)), 1e-9)
        if FIT_MIN <= keep.sum() < len(a):
            x, y = x[keep], y[keep]
            coef = np.linalg.lstsq(x, y, rcond=None)[0]
        # the upper end of b's 95 % interval: a noisy fit prices recomputing dearer (so the
        # decision leans to restoring, as without a margin), a clean one at b itself
        rss = float(np.sum((y - x @ coef) ** 2))
        cov = np.linalg.pinv(x.T @ x) * rss / max(1, len(y) - 3)
        return max(0.0, float(coef[1])) + 2.0 * float(np.sqrt(max(0.0, cov[1, 1])))


class Backlog:
    """Work queued (``add``) or in flight (``start``) on one resource until ``done``."""

    def __init__(self) -> None:
        self._work: dict[Hashable, list] = {}     # key -> [amount, started at or None]

    def add(self, key: Hashable, amount: float) -> None:
        """Queue ``amount`` of work for ``key`` (a known key keeps its place, takes the amount)."""
        self._work[key] = [max(0.0, float(amount)), None]

    def start(self, key: Hashable, now: float) -> None:
        """``key`` is now being served (a no-op for an unknown key)."""
        if key in self._work:
            self._work[key][1] = now

    def done(self, key: Hashable) -> None:
        """Forget ``key`` (a no-op for an unknown key)."""
        self._work.pop(key, None)

    def queued(self) -> float:
        """Work added and not yet started."""
        return sum(w[0] for w in self._work.values() if w[1] is None)

    def count(self, started: bool | None = None) -> int:
        """Items known (``started`` True: only those in flight; False: only those queued)."""
        return sum(1 for w in self._work.values()
                   if started is None or (w[1] is not None) == started)

    def remaining(self, now: float, rate: float | None, before: Hashable | None = None) -> float:
        """Work still to do: queued work whole, work in flight less what ``rate`` (shared by
        the work in flight) has served since it started; ``rate`` None counts it whole.
        ``before``: only the work added before that key (added earlier: ahead of it)."""
        running = [w for w in self._work.values() if w[1] is not None]
        share = rate / len(running) if rate and running else 0.0
        total = 0.0
        for k, w in self._work.items():
            if k == before:
                break
            total += w[0] if w[1] is None else max(0.0, w[0] - (now - w[1]) * share)
        return total
