"""``PrefillClock``: the prefill rate in linker mode, timed on the scheduler's own counter.

The linker sees only the batches that load something, so on a server that had stored nothing
yet its decision had no prefill price (and so restored at any price).  SGLang's scheduler
adds each batch's ``extend_num_tokens`` to ``processed_tokens_counter`` as it launches it,
and hands the counter to ``SchedulePolicy.calc_priority``, which the admission already hooks
(``admission._calc_priority_after``) once per step that has requests waiting.  Between two such
steps, the first of which saw requests waiting (so the scheduler ran without idling), the
tokens launched over the seconds passed is one sample of the prefill rate (decode steps in
between count their time too: the rate is, if anything, low, which leans to restoring); gaps
longer than ``MAX_GAP_S`` are not samples.
"""

from __future__ import annotations

import time
from typing import Any, Callable

MAX_GAP_S = 2.0


class PrefillClock:
    """Feeds ``rate`` (``sched.rates.Rate``: prefill tokens per second) from ``tick``."""

    def __init__(self, rate: Any, clock: Callable[[], float] = time.monotonic,
                 max_gap_s: float = MAX_GAP_S) -> None:
        self.rate, self.clock, self.max_gap_s = rate, clock, max_gap_s
        self.last: tuple[int, float, int] | None = None    # (tokens, time, waiting)

    def tick(self, processed_tokens: int, waiting: int) -> None:
        """The scheduler's counter at a step where ``waiting`` requests wait."""
        now, prev = self.clock(), self.last
        self.last = (int(processed_tokens), now, int(waiting))
        if prev is None or prev[2] <= 0:
            return
        tokens, seconds = int(processed_tokens) - prev[0], now - prev[1]
        if tokens > 0 and 0 < seconds <= self.max_gap_s:
            self.rate.observe(float(tokens), seconds)
