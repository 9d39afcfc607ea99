"""``PrefillClock``: the prefill rate in linker mode, timed over the step that launched it.

The linker sees only the batches that load something, so on a server that had stored nothing
yet its decision had no prefill price (and so restored at any price).  Two calls give it the
scheduler's steps:

- ``step()``: ``FlatCakeLinker.num_completed_offloads``, which SGLang calls once at the start
  of every scheduler step (``check_hicache_events``, before the step picks its batch);
- ``tick(processed_tokens, waiting)``: ``SchedulePolicy.calc_priority``, which the admission
  already hooks (``admission._calc_priority_after``), in a step that may launch a prefill.
  Its ``processed_tokens`` is SGLang's ``processed_tokens_counter``: every prefill token
  launched before this step;
- ``joined(prefix_tokens)``: a request joined this step's prefill batch
  (``PrefillAdder.add_one_req``, hooked by the admission) with that many cached tokens it
  attends to (its device prefix and what the linker restores), so each sample also has its
  context, and ``marginal`` (``sched.rates.Marginal``) learns what a new token adds at a
  fixed context.  A chunked request's next chunk joins without that call: its prefix is
  missed, which makes new tokens look dearer (the decision then leans to restoring).

A prefill is only launched in a step that ticked (SGLang calls ``calc_priority`` before it
builds any prefill batch), so the tokens between a tick and the next one were all launched in
the step of the first, and that step's seconds are from its start to the next step's start
(the longer of that step and the one after it: with SGLang's overlap schedule a batch's
forward ends in the step after its launch, so the rate is, if anything, low, which leans to
restoring).  Not samples: a step that also started a restore (``loading``: its time is the
restore's too), one longer than ``MAX_GAP_S``, and a step that launched nothing.  (The
earlier clock divided the tokens by the time between any two ticks, idle and decode steps
included: measured 780-1,100 tokens/s on a CPU server that prefilled about 36,000 in large
batches, so every restore looked cheaper than recomputing.)
"""

from __future__ import annotations

import time
from typing import Any, Callable

MAX_GAP_S = 2.0


class PrefillClock:
    """Feeds ``rate`` (``sched.rates.Rate``: prefill tokens per second) from the scheduler's
    steps; one owner: the linker's admission (scheduler thread)."""

    def __init__(self, rate: Any, clock: Callable[[], float] = time.monotonic,
                 max_gap_s: float = MAX_GAP_S, marginal: Any = None) -> None:
        self.rate, self.clock, self.max_gap_s = rate, clock, max_gap_s
        self.marginal = marginal             # ``sched.rates.Marginal`` or None
        self.prefix = 0                      # cached tokens of those that joined the ticked step
        self.starts: list[float] = []        # start times of the ticked step and those after
        self.ticked: tuple[int, bool] | None = None   # (tokens at its tick, it started loads)
        self.loads = False                   # this step started a restore

    def step(self) -> None:
        """A scheduler step starts."""
        self.starts.append(self.clock())
        self.loads = False
        if self.ticked is None:
            del self.starts[:-1]
        else:
            del self.starts[3:]              # the ticked step, the next and the one after

    def loading(self) -> None:
        """This step started a restore: its time is not prefill alone."""
        self.loads = True
        if self.ticked is not None and len(self.starts) == 1:
            self.ticked = (self.ticked[0], True)

    def tick(self, processed_tokens: int, waiting: int) -> None:
        """``calc_priority`` in this step, with SGLang's counter (``waiting`` is unused: a
        prefill is launched only in a step that ticked, whatever waits)."""
        tokens = int(processed_tokens)
        prev, starts = self.ticked, self.starts
        if prev is not None and len(starts) >= 2 and tokens > prev[0] and not prev[1]:
            seconds = starts[1] - starts[0]
            if len(starts) >= 3:
                seconds = max(seconds, starts[2] - starts[1])
            if 0 < seconds <= self.max_gap_s:
                new = float(tokens - prev[0])
                self.rate.observe(new, seconds)
                if self.marginal is not None:
                    self.marginal.observe(new, new + self.prefix, seconds)
        self.ticked = (tokens, self.loads)
        self.starts = starts[-1:]
        self.prefix = 0

    def joined(self, prefix_tokens: int) -> None:
        """A request joined the prefill batch of the step that last ticked, attending to
        ``prefix_tokens`` cached tokens."""
        self.prefix += max(0, int(prefix_tokens))
