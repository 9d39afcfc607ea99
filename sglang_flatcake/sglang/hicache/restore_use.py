"""Where restored KV goes: every restored token ends used by its request, or shows why not.

``DirectRestorer.finish`` publishes a restore's span ``[start, end)`` into the radix tree as
device nodes; the request is admitted later, when SGLang matches its prefix ``P`` on device and
credits ``min(P, end) - start`` tokens to storage (``cached_tokens_details.storage``).  The
ledger follows each published span until its request leaves the waiting queue and sorts its
tokens (the counters add up: ``published = used + evicted_before_use + departed + pending``):

- ``used``: the request was admitted on a prefix reaching into the span;
- ``evicted_before_use``: the request was admitted on a shorter prefix: the span's tail left
  the tree between publish and admission, and SGLang prefilled it again;
- ``departed``: the request left without being admitted (aborted);
- ``pending``: published, request not admitted yet.

Two more counts say where the work was wasted although the tokens were served:
``duplicate`` (tokens the insert found on device already: another request's restore or prefill
put them there first; SGLang frees the duplicate slots, so the read was wasted) and
``used_not_credited`` (used, but SGLang's ``cached_tokens_storage`` does not count them).

With ``hold`` the span stays locked in the tree from publish until its request leaves the
waiting queue (admitted requests hold their own lock on it by then), so nothing evicts it in
between; ``release_all`` lets a stalled scheduler evict it again.  Pure bookkeeping: the
caller owns the tree and passes what it needs in; nothing here touches SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

COUNTERS = ("restored_tokens_published", "restored_tokens_used",
            "restored_tokens_evicted_before_use", "restored_tokens_departed",
            "restored_tokens_pending", "restored_tokens_duplicate",
            "restored_tokens_used_not_credited", "restore_holds", "restore_holds_released_stalled")


@dataclass
class Span:
    """One published restore: request ``rid`` gets ``[start, end)``; ``lock``: what the caller
    passes back to release its hold (None: not held)."""
    rid: str
    start: int
    end: int
    lock: Any = None


class RestoreLedger:
    """Published spans until their requests leave the waiting queue, and the counters."""

    def __init__(self, hold: bool) -> None:
        self.hold = hold
        self.spans: dict[str, Span] = {}
        self.counters = {name: 0 for name in COUNTERS}

    def published(self, rid: str, start: int, tokens: int, duplicate: int,
                  lock: Any = None) -> Any:
        """``rid``'s restore put ``tokens`` tokens from ``start`` in the tree, ``duplicate`` of
        them already there; ``lock`` (when held) is handed to ``release`` later.  Returns the
        lock of an earlier span of ``rid`` it replaces (to release), else None."""
        if tokens <= 0:
            raise ValueError(f"published span of {tokens} tokens for {rid}: expected > 0")
        old = self.spans.pop(rid, None)
        if old is not None:          # a second restore for the request: the first one is spent
            self.counters["restored_tokens_pending"] -= old.end - old.start
            self.counters["restored_tokens_evicted_before_use"] += old.end - old.start
        c = self.counters
        c["restored_tokens_published"] += tokens
        c["restored_tokens_pending"] += tokens
        c["restored_tokens_duplicate"] += max(0, min(duplicate, tokens))
        c["restore_holds"] += lock is not None
        self.spans[rid] = Span(rid, start, start + tokens, lock)
        return old.lock if old is not None else None

    def admitted(self, rid: str, prefix: int, credited: int) -> Any:
        """``rid`` was admitted on a device prefix of ``prefix`` tokens, SGLang crediting
        ``credited`` to storage; returns the span's lock (to release) or None."""
        s = self.spans.pop(rid)
        tokens = s.end - s.start
        used = max(0, min(prefix, s.end) - s.start)
        c = self.counters
        c["restored_tokens_pending"] -= tokens
        c["restored_tokens_used"] += used
        c["restored_tokens_evicted_before_use"] += tokens - used
        c["restored_tokens_used_not_credited"] += max(0, used - credited)
        return s.lock

    def departed(self, rid: str) -> Any:
        """``rid`` left the waiting queue without being admitted; returns its lock or None."""
        s = self.spans.pop(rid)
        self.counters["restored_tokens_pending"] -= s.end - s.start
        self.counters["restored_tokens_departed"] += s.end - s.start
        return s.lock

    def settle(self, waiting: set[str], fate: Callable[[str], tuple[str, int, int]],
               release: Callable[[Any], None]) -> list[tuple[str, str, int, int]]:
        """Sort the spans of requests no longer in ``waiting``: ``fate(rid)`` says
        ``("admitted", prefix, credited)``, ``("departed", 0, 0)`` or ``("unknown", 0, 0)``
        (kept for a later step); each freed hold goes to ``release``.  Returns
        ``(rid, "admitted" | "departed", span tokens, tokens used)`` per span sorted."""
        out = []
        for rid in [r for r in self.spans if r not in waiting]:
            how, prefix, credited = fate(rid)
            if how == "unknown":
                continue
            s = self.spans[rid]
            used = max(0, min(prefix, s.end) - s.start) if how == "admitted" else 0
            lock = self.admitted(rid, prefix, credited) if how == "admitted" \
                else self.departed(rid)
            if lock is not None:
                release(lock)
            out.append((rid, how, s.end - s.start, used))
        return out

    def release_all(self, release: Callable[[Any], None]) -> int:
        """Drop every hold (the spans stay in the ledger, evictable now); how many."""
        n = 0
        for s in self.spans.values():
            if s.lock is not None:
                release(s.lock)
                s.lock = None
                n += 1
        self.counters["restore_holds_released_stalled"] += n
        return n

    def held(self) -> list[str]:
        """Requests whose span is held now."""
        return [s.rid for s in self.spans.values() if s.lock is not None]

    def stats(self) -> dict:
        return dict(self.counters)
