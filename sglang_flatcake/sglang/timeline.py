"""Per-request timeline of a server (``--flatcake-timeline PATH``): JSON lines, off by default.

The launcher (``plugin``) records PATH in ``TIMELINE_ENV`` and starts the ``timeline`` mode,
whose hooks (``hook_table``) mark every request's ``arrival``, its first ``forward`` (the
first prefill batch it is in) and its ``first_token`` (the batch's result processed), with or
without flatcake; the flatcake modes add their own stages at their call sites (``lookup``,
``decision`` with its inputs, ``picked``, ``restore_start``, ``restore_end``, ``published``).
Off, the mode's hooks are not registered and ``ON`` is False: every call site tests ``ON``
before it builds anything, so no per-request work is done.

One line per event: ``{"rid", "ev", "t" (time.monotonic(), seconds), "pid", ...fields}``.  An
arrival also carries ``prompt`` (a hash of the prompt's token ids: ``benchmarks/timeline_diff.py``
lines up two runs by it) and ``tokens``.  Lines are written whole with one ``write`` each, so
the ranks of one server may share a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from typing import Any

TIMELINE_ENV = "FLATCAKE_TIMELINE"    # set by the launcher, read by the processes it starts
ON = bool(os.environ.get(TIMELINE_ENV))
SEEN_MAX = 1 << 16                    # requests between forward and first token, at most


def prompt_hash(token_ids: Any) -> str:
    """A short hash of a prompt's token ids (the same ids give the same hash in any run);
    about 0.1 ms for 3,000 ids (joined as text it took 1.1 ms)."""
    import numpy as np
    ids = np.asarray(token_ids, dtype=np.int64)
    return hashlib.blake2b(ids.tobytes(), digest_size=8).hexdigest()


class Timeline:
    """Appends events to ``path`` as JSON lines; ``mark`` is thread-safe (the restore worker
    and the scheduler thread both mark)."""

    def __init__(self, path: str, clock=time.monotonic) -> None:
        self.path, self.clock = path, clock
        self.lock = threading.Lock()
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.pid = os.getpid()
        self.forwarded: dict[str, None] = {}     # rids seen in a prefill batch, no token yet

    def mark(self, rid: str, ev: str, **fields: Any) -> None:
        """Write one event for ``rid`` now (``fields`` must be JSON-serialisable)."""
        line = json.dumps({"rid": rid, "ev": ev, "t": round(self.clock(), 6), "pid": self.pid,
                           **fields}, separators=(",", ":")) + "\n"
        with self.lock:
            os.write(self.fd, line.encode())

    def close(self) -> None:
        os.close(self.fd)


_writer: Timeline | None = None


def writer() -> Timeline:
    """This process's timeline (opened on first use at ``$FLATCAKE_TIMELINE``)."""
    global _writer
    if _writer is None:
        _writer = Timeline(os.environ[TIMELINE_ENV])
    return _writer


def mark(rid: str, ev: str, **fields: Any) -> None:
    """``writer().mark``: callers test ``ON`` first."""
    writer().mark(rid, ev, **fields)


def enable(path: str) -> None:
    """Turn the timeline on for this process and the ones it starts (the launcher)."""
    global ON
    os.environ[TIMELINE_ENV] = os.path.abspath(path)
    ON = True


# -- the ``timeline`` mode's hooks (registered only when the flag is given) ----------------
def _arrival_before(scheduler, recv_req, *a, **kw) -> None:
    ids = recv_req.input_ids if recv_req.input_ids is not None else ()
    mark(recv_req.rid, "arrival", prompt=prompt_hash(ids), tokens=len(ids),
         waiting=len(scheduler.waiting_queue))


def _run_batch_before(scheduler, batch, *a, **kw) -> None:
    if batch is None or batch.forward_mode is None or not batch.forward_mode.is_extend():
        return
    w = writer()
    for r in batch.reqs:
        if r.rid not in w.forwarded:
            w.forwarded[r.rid] = None
            w.mark(r.rid, "forward", prefix=int(r.prefix_len), batch=len(batch.reqs),
                   batch_tokens=int(batch.extend_num_tokens or 0))
    while len(w.forwarded) > SEEN_MAX:          # a request that never got its token
        del w.forwarded[next(iter(w.forwarded))]


def _result_after(result, scheduler, batch, *a, **kw):
    if batch is None or batch.forward_mode is None or not batch.forward_mode.is_extend():
        return result
    w = writer()
    for r in batch.reqs:
        if r.rid in w.forwarded and r.output_ids:      # a chunk before the last has none
            del w.forwarded[r.rid]
            w.mark(r.rid, "first_token")
    return result


# -- flatcake's stages (called by both modes only when ``ON``) -----------------------------
def decision(rid: str, choice: Any, decider: Any, at: str, agreed: bool, **inputs: Any) -> None:
    """Mark a restore-or-recompute decision: the agreed answer, this rank's estimate
    (``sched.recompute.Choice``) and the prices and backlogs it was made from."""
    mark(rid, "decision", at=at, restore=bool(agreed), restore_s=choice.restore_s,
         recompute_s=choice.recompute_s, prefill_tokens_per_s=decider.prefill.value,
         prefill_marginal_s_per_token=None if decider.marginal is None
         else decider.marginal.per_token(), restore_bytes_per_s=decider.restore.value,
         restore_latency_s=decider.restore.latency,
         restore_slip=decider.slip.value, **inputs)
