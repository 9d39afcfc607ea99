"""Measured throughput and queued work: ``Rate`` and ``Backlog`` (for ``recompute`` and ``queues``).

Plain arithmetic over an injected notion of time: callers pass ``now`` and the
measured seconds, so the same classes serve the server (its monotonic clock) and
the replay (virtual time).
"""

from __future__ import annotations

from typing import Hashable

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

    @property
    def value(self) -> float | None:
        return self._sums[0] / self._sums[1] if self._sums[1] > 0 else None


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
