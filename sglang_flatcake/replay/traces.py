"""Trace loaders: Mooncake JSON lines and WEKA kv-cache-tester session files.

A loaded ``Trace`` is a tuple of ``Request`` grouped two ways:

- a *conversation* is a chain of turns, each turn released only after the
  previous one's prefill (WEKA: a session's main thread, or one sub-agent;
  Mooncake: a request continues the most recent earlier request whose id chain,
  all but possibly its last, partial block, is a prefix of its own);
- a *session* is the unit that ``--sessions`` samples and that arrival
  schedules stagger (WEKA: one file with its sub-agents; Mooncake: one root
  conversation with its continuations).

Block keys are 64-hex strings unique per (key scope, hash id): every WEKA file
is its own scope (its ids are local), Mooncake is one global scope.

Every malformed record raises ``TraceError`` whose message starts with
``file:line:``; a truncated or corrupt compressed file names the file.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field, replace

from ..errors import FlatCakeError

FORMATS = ("auto", "mooncake", "weka")


class TraceError(FlatCakeError, ValueError):
    """A trace file or record that cannot be used; the message starts with ``file:line:``."""


@dataclass(frozen=True)
class Request:
    rid: int                 # position in the trace (sessions in order, turns in order)
    session: int             # index of the session (see module docstring)
    conv: int                # index of the conversation
    scope: str               # key namespace of the hash ids
    t: float                 # seconds: from the session start (WEKA) or the trace start (Mooncake)
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    turn: int                # 0 for the first turn of a conversation
    prev_out: int            # the previous turn's output tokens (0 on a first turn)
    parent: int | None       # rid of the previous turn of the conversation
    origin: str              # "file:line" it was read from


@dataclass(frozen=True)
class Trace:
    name: str
    format: str              # "mooncake" or "weka"
    block_tokens: int
    requests: tuple[Request, ...]
    n_sessions: int
    _keys: dict = field(default_factory=dict, compare=False, repr=False)

    def keys(self, req: Request) -> list[str]:
        """The request's block keys in chain order (memoised)."""
        cache = self._keys
        out = []
        for h in req.hash_ids:
            k = cache.get((req.scope, h))
            if k is None:
                k = hashlib.blake2b(f"{req.scope}:{h}".encode(), digest_size=32).hexdigest()
                cache[(req.scope, h)] = k
            out.append(k)
        return out

    def unique_blocks(self) -> int:
        return len({(r.scope, h) for r in self.requests for h in r.hash_ids})

    def select_sessions(self, k: int | None, seed: int = 0) -> "Trace":
        """A trace of ``k`` sessions drawn with ``seed`` (all when ``k`` is None or too big),
        renumbered, in their original order."""
        if k is None or k >= self.n_sessions:
            return self
        if k <= 0:
            raise ValueError(f"--sessions must be positive, got {k}")
        keep = sorted(random.Random(seed).sample(range(self.n_sessions), k))
        return _renumber(self, keep)


    def split(self, first: int) -> tuple["Trace", "Trace"]:
        """Sessions ``0..first-1`` and ``first..``, each renumbered; ``ValueError`` unless
        both are non-empty."""
        if not 0 < first < self.n_sessions:
            raise ValueError(f"cannot split {self.n_sessions} sessions after {first}: "
                             "both parts need at least one session")
        return (_renumber(self, list(range(first))),
                _renumber(self, list(range(first, self.n_sessions))))


def _renumber(trace: Trace, keep: list[int]) -> Trace:
    new_sid = {s: i for i, s in enumerate(keep)}
    reqs = [r for r in trace.requests if r.session in new_sid]
    new_rid = {r.rid: i for i, r in enumerate(reqs)}
    convs: dict[int, int] = {}
    out = []
    for r in reqs:
        c = convs.setdefault(r.conv, len(convs))
        out.append(replace(r, rid=new_rid[r.rid], session=new_sid[r.session], conv=c,
                           parent=None if r.parent is None else new_rid[r.parent]))
    return Trace(trace.name, trace.format, trace.block_tokens, tuple(out), len(keep))


def arrivals(trace: Trace, rate: float) -> list[float]:
    """Nominal arrival time (seconds) of every request at a mean rate of ``rate`` req/s.

    Mooncake: the trace's timestamps scaled so that the mean rate is ``rate``.
    WEKA: session k starts once the requests of sessions 0..k-1 would have
    arrived at ``rate`` (start_k = requests before k / rate), keeping the
    trace's offsets within each session; then, if that timeline is longer than
    N / rate (sessions last longer than their share), every time is multiplied
    by one factor so that it spans N / rate: think times shrink when the trace
    has too few sessions to reach the rate otherwise.
    """
    if not rate > 0:
        raise ValueError(f"rate must be positive, got {rate}")
    reqs = trace.requests
    n = len(reqs)
    if trace.format == "mooncake":
        t0, t1 = reqs[0].t, reqs[-1].t
        native = (n - 1) / (t1 - t0) if t1 > t0 else rate
        return [(r.t - t0) * native / rate for r in reqs]
    count = [0] * trace.n_sessions
    for r in reqs:
        count[r.session] += 1
    start, acc = [], 0
    for c in count:
        start.append(acc / rate)
        acc += c
    times = [start[r.session] + r.t for r in reqs]
    span = max(times) - min(times) if times else 0.0
    factor = min(1.0, (n / rate) / span) if span > 0 else 1.0
    return [t * factor for t in times]
