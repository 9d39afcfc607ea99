"""The paper's metrics, per system and rate.

- hit rate delivered: reused blocks in device memory when prefill starts, over
  blocks requested (every request's ``hash_ids``);
- hit rate max: the same for an infinite cache that holds every block of every
  earlier request (nominal arrival order, ties by trace order);
- read amplification: bytes read from SSD over bytes of SSD blocks delivered
  (null when nothing was delivered from SSD);
- read commands: SSD read commands issued (real, at the real layout);
- prefetch time: arrival to the end of the SSD prefetch, over prefetches that
  completed (not cancelled); mean and P99;
- SSD read bandwidth: full-size bytes read / virtual time with a read in flight;
- prefetch cancelled: prefetches given up (staging full);
- recomputed requests / tokens: requests whose SSD part was recomputed instead of
  restored (``sched.recompute``), and those tokens;
- TTFT: arrival (release) to the end of prefill; mean, P50 and P99;
- P99 disk share: over the requests whose TTFT is at least the P99, the share of
  their TTFT during which no prefill ran anywhere (the GPU idle while they waited:
  the wait was for SSD restores, theirs or a head's), against prefill queueing and
  prefill; ``tail_disk_share``;
- throughput: requests / (last first token - first arrival).

Percentiles are nearest-rank: P99 of n values is the ceil(0.99 n)-th smallest.
Times are full-size virtual seconds (see ``sizes``).
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

from .clock import SharedDisk
from .sizes import GIB
from .systems.base import IoCounters, RequestState
from .traces import Trace

FIELDS = ("system", "policy", "rate", "hit_rate_delivered", "hit_rate_max", "read_amplification",
          "read_commands", "prefetch_s_mean", "prefetch_s_p99", "ssd_read_gib_s",
          "prefetch_cancelled", "recomputed_requests", "recomputed_tokens", "ttft_s_mean",
          "ttft_s_p50", "ttft_s_p99", "ttft_p99_disk_share", "throughput_rps")
TIMING_FIELDS = ("prefetch_s_mean", "prefetch_s_p99", "ssd_read_gib_s", "ttft_s_mean",
                 "ttft_s_p50", "ttft_s_p99", "ttft_p99_disk_share", "throughput_rps")


def nearest_rank(n: int, q: float) -> int:
    """The rank (1 = fastest) of the ``q``-th percentile of ``n`` values, nearest-rank."""
    if not 0 < q <= 100:
        raise ValueError(f"percentile q must be in (0, 100], got {q}")
    return max(1, math.ceil(q / 100 * n))


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in (0, 100]); None for no values."""
    if not values:
        return None
    return sorted(values)[nearest_rank(len(values), q) - 1]


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def infinite_cache_hits(trace: Trace, nominal: Sequence[float]) -> list[int]:
    """Per request (trace order): leading blocks already seen in an earlier request."""
    seen: set = set()
    out = [0] * len(trace.requests)
    for r in sorted(trace.requests, key=lambda r: (nominal[r.rid], r.rid)):
        n = 0
        for h in r.hash_ids:
            if (r.scope, h) not in seen:
                break
            n += 1
        out[r.rid] = n
        seen.update((r.scope, h) for h in r.hash_ids)
    return out


def tail_disk_share(states: Sequence[RequestState], q: float = 99) -> float | None:
    """Of the requests whose TTFT is at least its ``q`` percentile, the share of their summed
    TTFT during which no prefill was running (``prefill_start`` to ``first_token`` of any
    request); None for no requests or a zero TTFT sum."""
    ttft = [s.first_token - s.arrival for s in states]
    cut = percentile(ttft, q)
    if cut is None:
        return None
    busy: list[list[float]] = []
    for a, b in sorted((s.prefill_start, s.first_token) for s in states
                       if s.prefill_start is not None):
        if busy and a <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], b)
        else:
            busy.append([a, b])
    starts = [iv[0] for iv in busy]
    total = idle = 0.0
    for s, t in zip(states, ttft):
        if t < cut:
            continue
        lo, hi = s.arrival, s.first_token
        covered = 0.0
        for a, b in busy[max(0, bisect.bisect_right(starts, lo) - 1):bisect.bisect_left(starts, hi)]:
            covered += max(0.0, min(b, hi) - max(a, lo))
        total += hi - lo
        idle += hi - lo - covered
    return idle / total if total > 0 else None


def tail_split(states: Sequence[RequestState]) -> dict:
    """Shares of the P99 requests' summed TTFT: restore wait, restore, ready queue, prefill."""
    ttft = [s.first_token - s.arrival for s in states]
    cut = percentile(ttft, 99)
    parts = {"restore_wait": 0.0, "restore": 0.0, "ready_queue": 0.0, "prefill": 0.0}
    total = 0.0
    for s, t in zip(states, ttft):
        if t < cut:
            continue
        total += t
        if s.prefetch_start is not None:
            parts["restore_wait"] += s.prefetch_start - s.arrival
            parts["restore"] += s.prefetch_end - s.prefetch_start
        else:      # no restore ran: waited for one until declined (recompute), if at all
            parts["restore_wait"] += s.ready_at - s.arrival
        parts["ready_queue"] += s.prefill_start - s.ready_at
        parts["prefill"] += s.first_token - s.prefill_start
    return {k: round(v / total, 4) for k, v in parts.items()} if total else parts


def _r(x: float | None, nd: int = 6) -> float | None:
    return None if x is None else round(float(x), nd)


def summarize(system: str, rate: float, states: Sequence[RequestState], max_hits: Sequence[int],
              io: IoCounters, disk: SharedDisk, policy: str = "-") -> dict:
    """One JSON row with exactly ``FIELDS``; ``policy`` is the scheduler it ran under."""
    blocks = sum(len(s.req.hash_ids) for s in states)
    delivered = sum(s.delivered for s in states)
    pre = [s.prefetch_end - s.arrival for s in states
           if s.prefetch_end is not None and not s.cancelled]
    ttft = [s.first_token - s.arrival for s in states]
    span = max(s.first_token for s in states) - min(s.arrival for s in states) if states else 0
    amp = (io.ssd_bytes_read / io.ssd_bytes_delivered) if io.ssd_bytes_delivered else None
    bw = disk.read_bytes / disk.read_busy_s / GIB if disk.read_busy_s > 0 else None
    row = {
        "system": system,
        "policy": policy,
        "rate": rate,
        "hit_rate_delivered": _r(delivered / blocks if blocks else 0.0),
        "hit_rate_max": _r(sum(max_hits) / blocks if blocks else 0.0),
        "read_amplification": _r(amp, 4),
        "read_commands": int(io.read_commands),
        "prefetch_s_mean": _r(mean(pre)),
        "prefetch_s_p99": _r(percentile(pre, 99)),
        "ssd_read_gib_s": _r(bw, 4),
        "prefetch_cancelled": int(io.prefetch_cancelled),
        "recomputed_requests": sum(1 for s in states if s.recomputed_tokens),
        "recomputed_tokens": sum(s.recomputed_tokens for s in states),
        "ttft_s_mean": _r(mean(ttft)),
        "ttft_s_p50": _r(percentile(ttft, 50)),
        "ttft_s_p99": _r(percentile(ttft, 99)),
        "ttft_p99_disk_share": _r(tail_disk_share(states), 4),
        "throughput_rps": _r(len(states) / span if span > 0 else None),
    }
    assert tuple(row) == FIELDS
    return row
