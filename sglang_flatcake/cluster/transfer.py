"""A thin wrapper over Mooncake's Transfer Engine: register buffers, read remote ranges
within a bound.

One engine per process, initialised with ``P2PHANDSHAKE`` metadata (no metadata server:
peers name each other ``host:rpc_port``) over ``protocol`` (``tcp`` here, ``rdma`` in
production) on the operator's bind address.  The engine's own status call blocks until a
batch ends (and a stopped peer never ends it), so each read runs on a worker thread and the
caller waits at most ``timeout_s``: a late read is abandoned, and the buffer it targets stays
*quarantined* (``ReadResult.quarantined``) until the worker returns -- the caller must not
reuse it before then.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..config import check_ip
from ..errors import ConfigError, FlatCakeError


class TransferError(FlatCakeError):
    """The Transfer Engine could not start or register memory (nothing stays registered)."""


@dataclass(frozen=True)
class ReadResult:
    ok: bool
    reason: str                       # "" when ok; else "failed" | "timeout" | "too many late"
    quarantined: threading.Event | None = None   # set once an abandoned read has ended


def check_host(host: str) -> str:
    """``host`` must be an IP address (the operator's bind address); ``ConfigError`` if not."""
    return check_ip(host, "host")


class Engine:
    """One Transfer Engine.  ``session`` is the name peers use to reach it."""

    MAX_LATE = 4                      # abandoned reads in flight before a peer is refused

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp",
                 metadata: str = "P2PHANDSHAKE", device: str = "") -> None:
        from mooncake.engine import TransferEngine
        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"protocol={protocol!r} is not allowed: tcp or rdma")
        self.host = check_host(host)
        self._te = TransferEngine()
        rc = self._te.initialize(host, metadata, protocol, device)
        if rc != 0:
            raise TransferError(f"Transfer Engine initialize({host!r}, {metadata!r}, "
                                f"{protocol!r}) returned {rc}")
        self.session = f"{host}:{self._te.get_rpc_port()}"
        self._registered: list[np.ndarray] = []   # owned here: kept alive while registered
        self._late = 0
        self._lock = threading.Lock()

    def register(self, buf: np.ndarray) -> int:
        """Register ``buf`` (C-contiguous) for transfers; returns its address.  The engine
        keeps a reference until ``close``."""
        if not buf.flags.c_contiguous:
            raise ValueError("register: buffer must be C-contiguous")
        addr = buf.ctypes.data
        rc = self._te.register_memory(addr, buf.nbytes)
        if rc != 0:
            raise TransferError(f"register_memory({buf.nbytes} bytes) returned {rc}")
        self._registered.append(buf)
        return addr

    def read(self, peer: str, local: Sequence[int], remote: Sequence[int],
             lengths: Sequence[int], timeout_s: float) -> ReadResult:
        """Read ``lengths[i]`` bytes at ``remote[i]`` on ``peer`` into ``local[i]`` (all
        registered), as one batch.  Returns within ``timeout_s`` (plus thread start-up)."""
        if timeout_s <= 0:
            return ReadResult(False, "timeout")
        return self.start_read(peer, local, remote, lengths).wait(timeout_s)

    def start_read(self, peer: str, local: Sequence[int], remote: Sequence[int],
                   lengths: Sequence[int]) -> "PendingRead":
        """Start ``read``'s batch on a worker thread and return at once; the caller may work
        (verify the previous chunk) while it moves, then ``wait`` on it."""
        with self._lock:
            refused = self._late >= self.MAX_LATE
        done = threading.Event()
        out: dict[str, int] = {}
        if refused:
            return PendingRead(self._abandon, done, out, "too many late")

        def work() -> None:
            try:
                bid = self._te.batch_transfer_async_read(peer, list(local), list(remote),
                                                         list(lengths))
                out["status"] = (-1 if bid <= 0 else self._poll(bid) if len(local) == 1
                                 else self._te.get_batch_transfer_status([bid]))
            finally:
                done.set()

        threading.Thread(target=work, name="fc-te-read", daemon=True).start()
        return PendingRead(self._abandon, done, out, "")

    def _poll(self, bid: int) -> int:
        """0 once the single-entry batch ``bid`` completed, else -1.  The engine's
        ``get_batch_transfer_status`` spins a core until the batch ends (on two cores, the
        one the transfer and the checksums need); this sleeps between status checks instead.
        Only for one entry: ``transfer_check_status`` looks at the batch's first entry alone."""
        pause = 0.0002
        while (st := self._te.transfer_check_status(bid)) == 0:
            time.sleep(pause)
            pause = min(pause * 1.5, 0.001)
        return 0 if st == 1 else -1

    def _abandon(self, done: threading.Event) -> threading.Event:
        """Count a late read until its worker returns; the event is set then."""
        with self._lock:
            self._late += 1
        ended = threading.Event()

        def reap() -> None:
            done.wait()
            with self._lock:
                self._late -= 1
            ended.set()

        threading.Thread(target=reap, name="fc-te-reap", daemon=True).start()
        return ended

    def close(self) -> None:
        """Unregister every buffer (the engine itself lives until the process ends)."""
        for buf in self._registered:
            self._te.unregister_memory(buf.ctypes.data)
        self._registered.clear()


class PendingRead:
    """A started batch (``Engine.start_read``); ``wait`` it exactly once.  ``abandon``: the
    engine's count of a late read, given its event."""

    def __init__(self, abandon: Callable[[threading.Event], threading.Event],
                 done: threading.Event, out: dict, refused: str) -> None:
        self._abandon, self._done, self._out, self._refused = abandon, done, out, refused
        self._result: ReadResult | None = None

    def wait(self, timeout_s: float) -> ReadResult:
        """The batch's result within ``timeout_s``; a late batch is abandoned and its target
        buffer quarantined (``ReadResult.quarantined``).  Later calls return the first answer."""
        if self._refused:
            return ReadResult(False, self._refused)
        if self._result is None:
            if not self._done.wait(max(timeout_s, 0.0)):
                self._result = ReadResult(False, "timeout", self._abandon(self._done))
            elif self._out.get("status") == 0:
                self._result = ReadResult(True, "")
            else:
                self._result = ReadResult(False, "failed")
        return self._result
