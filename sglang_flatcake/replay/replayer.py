"""One replay: a trace at one rate through one system under one policy.

Requests arrive at their nominal times, except that a conversation's next turn
is released no earlier than the previous turn's prefill end (its reply exists
only then).  At arrival the system looks the prefix up; a request that needs
the SSD waits for a restore slot (policy order), then for its restore; a ready
request waits for one of ``max_prefills`` prefill slots (policy order).
Prefill time = host-to-device copy of the delivered blocks that come from host
memory + recomputed tokens / prefill tokens per second, so
TTFT = queueing + restore + recompute.  A ``layer_wise`` system (flatcake-linker) reads
its SSD part inside the prefill instead, so its prefill ends at ``layerwise.pipeline_end``
of the read and the compute, the GPU held throughout.  After the prefill the request's blocks
are written (write-through), then its successors in the conversation may come.

With a system that can decline a restore (flatcake with ``recompute_when_faster``)
``recompute.ReplayDecision`` decides at arrival, and again when the restore would
start, whether to restore or recompute the request's SSD part, under every policy.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable

from ..placement import WriteSignals
from .clock import EventLoop
from .layerwise import pipeline_end
from .policy import Policy
from .recompute import ReplayDecision
from .sizes import GIB, GpuPreset
from .systems.base import RequestState, System
from .traces import Request, Trace


class RefTracker:
    """How many conversations hold a block: those with a request in flight that
    contains it, or whose last such request ended at most ``recent_s`` ago."""

    def __init__(self, recent_s: float) -> None:
        self.recent_s = recent_s
        self._m: dict[str, dict[int, list]] = {}   # key -> conv -> [in flight, last end]

    def begin(self, conv: int, keys: list[str]) -> None:
        for k in keys:
            e = self._m.setdefault(k, {}).setdefault(conv, [0, float("-inf")])
            e[0] += 1

    def end(self, conv: int, keys: list[str], now: float) -> None:
        for k in keys:
            e = self._m[k][conv]
            e[0] -= 1
            e[1] = now

    def count(self, key: str, now: float) -> int:
        d = self._m.get(key)
        if not d:
            return 0
        return sum(1 for a, t in d.values() if a > 0 or now - t <= self.recent_s)


class SignalSource:
    """Write-time signals of one request's blocks, computed only for the blocks asked."""

    def __init__(self, req: Request, keys: list[str], refs: RefTracker, now: float) -> None:
        self.req, self.keys, self.refs, self.now = req, keys, refs, now

    def from_block(self, i: int) -> list[WriteSignals]:
        r = self.req
        return [WriteSignals(refcount=max(1, self.refs.count(k, self.now)), turn=r.turn,
                             context_tokens=r.input_tokens, prev_reply_tokens=r.prev_out)
                for k in self.keys[i:]]


class Replayer:
    def __init__(self, trace: Trace, nominal: list[float], system: System, policy: Policy,
                 gpu: GpuPreset, loop: EventLoop, max_prefills: int = 1, recent_s: float = 30.0,
                 progress: Callable[[int, int, float], None] | None = None) -> None:
        if max_prefills < 1:
            raise ValueError(f"max_prefills must be >= 1, got {max_prefills}")
        self.trace, self.nominal, self.system, self.policy = trace, nominal, system, policy
        self.gpu, self.loop, self.max_prefills = gpu, loop, max_prefills
        self.refs = RefTracker(recent_s) if system.wants_refcounts else None
        self.progress = progress
        self.states: dict[int, RequestState] = {}
        self._children: dict[int, list[Request]] = defaultdict(list)
        self._running = 0
        self._restoring = 0
        self._done = 0
        self._last_report = 0.0
        self.decision = ReplayDecision.for_system(system, policy, gpu, trace.block_tokens)
        self.layers = system.ctx.sizing.model.layers if system.ctx is not None else 1

    def run(self) -> list[RequestState]:
        """Replay every request; returns their states in trace order."""
        for r in self.trace.requests:
            if r.parent is None:
                self.loop.at(self.nominal[r.rid], self._arrive, r)
            else:
                self._children[r.parent].append(r)
        self.loop.run()
        n = len(self.trace.requests)
        if self._done != n:
            raise RuntimeError(f"{self.system.name}: replay stalled with {n - self._done} of {n} "
                               "requests unfinished (a restore never reported done)")
        return [self.states[r.rid] for r in self.trace.requests]

    def _arrive(self, r: Request) -> None:
        now = self.loop.now
        rs = RequestState(r, self.trace.keys(r), now)
        self.states[r.rid] = rs
        if self.refs is not None:
            self.refs.begin(r.conv, rs.keys)
        self.system.lookup(rs)
        if self.decision is not None:
            self.decision.arrived(rs, now)
        self.policy.arrived(rs, now)
        if rs.needs_restore:
            self._pump_restores()
        else:
            self._ready(rs)

    def _ready(self, rs: RequestState) -> None:
        rs.ready_at = self.loop.now
        self.policy.ready(rs, self.loop.now)
        self._pump_prefill()

    def _pump_restores(self) -> None:
        slots = self.system.restore_slots
        while slots is None or self._restoring < slots:
            rs = self.policy.next_restore(self.loop.now)
            if rs is None:
                return
            if self.decision is not None and not self.decision.starts(rs, self.loop.now):
                self._ready(rs)           # recomputed after all: ready now, nothing read
                continue
            self._restoring += 1
            self.system.start_restore(rs, self._restored)

    def _restored(self, rs: RequestState) -> None:
        self._restoring -= 1
        if self.decision is not None:
            self.decision.restored(rs, self.loop.now)
        self._ready(rs)
        self._pump_restores()

    def _pump_prefill(self) -> None:
        while self._running < self.max_prefills:
            rs = self.policy.next_prefill(self.loop.now)
            if rs is None:
                return
            rs.prefill_start = self.loop.now
            if self.decision is not None:
                self.decision.prefill_started(rs, self.loop.now)
            self.system.begin_prefill(rs)
            r = rs.req
            recompute = max(0, r.input_tokens - rs.delivered * self.trace.block_tokens)
            h2d = rs.h2d_full_bytes / (self.gpu.h2d_gib_s * GIB)
            compute = recompute / self.gpu.prefill_tps
            self._running += 1
            if self.system.layer_wise:
                self.loop.after(h2d, self._read_layers, rs, compute)
            else:
                self.loop.after(h2d + compute, self._prefilled, rs)
            self._pump_restores()     # a policy may let a restore start once the head has moved

    def _read_layers(self, rs: RequestState, compute_s: float) -> None:
        """Layer-wise systems, once the memory pages are on the device: the SSD part is read
        while the prefill runs, layer l's prefill waiting for layer l (``layerwise``)."""
        t0 = self.loop.now

        def landed() -> None:
            end = pipeline_end(t0, t0, self.loop.now - t0, compute_s, self.layers)
            self.loop.at(end, self._prefilled, rs)
        if not self.system.read_layers(rs, landed):
            self.loop.after(compute_s, self._prefilled, rs)

    def _prefilled(self, rs: RequestState) -> None:
        now = self.loop.now
        rs.first_token = now
        self._running -= 1
        if self.decision is not None:
            self.decision.prefilled(rs)
        r = rs.req
        sig = SignalSource(r, rs.keys, self.refs, now) if self.refs is not None else None
        self.system.write(rs, sig)
        if self.refs is not None:
            self.refs.end(r.conv, rs.keys, now)
        for c in self._children.pop(r.rid, ()):
            self.loop.at(max(self.nominal[c.rid], now), self._arrive, c)
        self._done += 1
        if self.progress is not None:
            t = time.monotonic()
            if t - self._last_report > 2.0 or self._done == len(self.trace.requests):
                self._last_report = t
                self.progress(self._done, len(self.trace.requests), now)
        self._pump_prefill()
