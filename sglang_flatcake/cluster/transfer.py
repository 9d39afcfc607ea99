"""A thin wrapper over Mooncake's Transfer Engine: register buffers, read remote ranges
within a bound.

One engine per process, initialised with ``P2PHANDSHAKE`` metadata (no metadata server:
peers name each other ``host:rpc_port``) over ``protocol`` (``tcp`` here, ``rdma`` in
production) on the operator's bind address.  The engine's own status call blocks until a
batch ends (and a stopped peer never ends it), so each read runs on a worker thread and the
caller waits at most ``timeout_s``: a late read is abandoned, and the buffer it targets stays
*quarantined* (``ReadResult.quarantined``) until the worker returns -- the caller must not
reuse it before then.

What the engine trusts: its data plane has no authentication.  Any process that reaches its
ports can read or write any memory registered with it (the server side checks only that the
range lies in a registered buffer).  So nothing at rest is registered here: an owner registers
one staging slot per grant and unregisters it at the ack or the lease's end (``register`` /
``unregister``), and over ``tcp`` a requester reads into unregistered memory (the engine
allows it), so nothing a peer could write is ever verified or scattered.  Mooncake 0.3.13
listens on every interface whatever ``host`` says (its handshake and data ports); the
listeners it opened are in ``exposed`` and logged, so the operator can firewall them to the
cluster network (docs/cluster-security.md).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..config import check_ip
from ..errors import ConfigError, FlatCakeError

log = logging.getLogger("sglang_flatcake")


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

    MAX_LATE = 8                      # abandoned reads in flight, all peers together
    MAX_LATE_PER_PEER = 2             # ... per peer: one stalled peer stops only itself
    # a batch that failed (not one still running) is sent once more: over tcp the engine's
    # pooled connection to a peer can be dead (seen in CI: "failed to read READ status frame.
    # End of file" from a live owner), and the engine opens a new one for the next batch;
    # reads are idempotent, and the caller's ``wait`` bounds both tries together
    RETRIES = 1

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp",
                 metadata: str = "P2PHANDSHAKE", device: str = "") -> None:
        from mooncake.engine import TransferEngine
        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"protocol={protocol!r} is not allowed: tcp or rdma")
        self.host = check_host(host)
        self.protocol = protocol
        self.registers_local = protocol != "tcp"   # tcp reads into unregistered memory
        before = listening()
        self._te = TransferEngine()
        rc = self._te.initialize(host, metadata, protocol, device)
        if rc != 0:
            raise TransferError(f"Transfer Engine initialize({host!r}, {metadata!r}, "
                                f"{protocol!r}) returned {rc}")
        self.session = f"{host}:{self._te.get_rpc_port()}"
        self.exposed = sorted(a for a in listening() - before
                              if a.rsplit(":", 1)[0] not in (host, f"[{host}]"))
        if self.exposed:
            log.warning("flatcake: the Transfer Engine listens on %s, not only on %s (Mooncake "
                        "does not bind them): firewall these ports to the cluster network",
                        ", ".join(self.exposed), host)
        self._registered: dict[int, np.ndarray] = {}   # addr -> buffer, kept alive while registered
        self._late: dict[str, int] = {}
        self._retried = 0
        self._lock = threading.Lock()

    def register(self, buf: np.ndarray) -> int:
        """Register ``buf`` (C-contiguous) for transfers -- every peer can then read and
        write it -- and return its address.  The engine keeps a reference until
        ``unregister`` or ``close``."""
        if not buf.flags.c_contiguous:
            raise ValueError("register: buffer must be C-contiguous")
        addr = buf.ctypes.data
        rc = self._te.register_memory(addr, buf.nbytes)
        if rc != 0:
            raise TransferError(f"register_memory({buf.nbytes} bytes) returned {rc}")
        with self._lock:
            self._registered[addr] = buf
        return addr

    def unregister(self, addr: int) -> None:
        """Stop exposing the buffer registered at ``addr`` (a no-op when it is not)."""
        with self._lock:
            buf = self._registered.pop(addr, None)
        if buf is not None:
            self._te.unregister_memory(addr)

    @property
    def registered_bytes(self) -> int:
        """Bytes registered now (what peers could reach)."""
        with self._lock:
            return sum(b.nbytes for b in self._registered.values())

    @property
    def retried(self) -> int:
        """Batches sent once more after a failure (``RETRIES``), since the engine started."""
        with self._lock:
            return self._retried

    def late(self, peer: str) -> int:
        """Abandoned reads from ``peer`` still in flight."""
        with self._lock:
            return self._late.get(peer, 0)

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
            refused = (self._late.get(peer, 0) >= self.MAX_LATE_PER_PEER
                       or sum(self._late.values()) >= self.MAX_LATE)
        done = threading.Event()
        out: dict[str, int] = {}
        if refused:
            return PendingRead(self._abandon, done, out, "too many late", peer)

        def work() -> None:
            try:
                for attempt in range(1 + self.RETRIES):
                    if attempt:
                        with self._lock:
                            self._retried += 1
                    bid = self._te.batch_transfer_async_read(peer, list(local), list(remote),
                                                             list(lengths))
                    out["status"] = (-1 if bid <= 0 else self._poll(bid) if len(local) == 1
                                     else self._te.get_batch_transfer_status([bid]))
                    if out["status"] == 0:
                        break
            finally:
                done.set()

        threading.Thread(target=work, name="fc-te-read", daemon=True).start()
        return PendingRead(self._abandon, done, out, "", peer)

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

    def _abandon(self, done: threading.Event, peer: str) -> threading.Event:
        """Count a late read from ``peer`` until its worker returns; the event is set then."""
        with self._lock:
            self._late[peer] = self._late.get(peer, 0) + 1
        ended = threading.Event()

        def reap() -> None:
            done.wait()
            with self._lock:
                self._late[peer] -= 1
                if not self._late[peer]:
                    del self._late[peer]
            ended.set()

        threading.Thread(target=reap, name="fc-te-reap", daemon=True).start()
        return ended

    def close(self) -> None:
        """Unregister every buffer (the engine itself lives until the process ends)."""
        with self._lock:
            addrs = list(self._registered)
        for addr in addrs:
            self.unregister(addr)


class PendingRead:
    """A started batch (``Engine.start_read``); ``wait`` it exactly once.  ``abandon``: the
    engine's count of a late read, given its event."""

    def __init__(self, abandon: Callable[[threading.Event, str], threading.Event],
                 done: threading.Event, out: dict, refused: str, peer: str) -> None:
        self._abandon, self._done, self._out, self._refused = abandon, done, out, refused
        self._peer = peer
        self._result: ReadResult | None = None

    def wait(self, timeout_s: float) -> ReadResult:
        """The batch's result within ``timeout_s``; a late batch is abandoned and its target
        buffer quarantined (``ReadResult.quarantined``).  Later calls return the first answer."""
        if self._refused:
            return ReadResult(False, self._refused)
        if self._result is None:
            if not self._done.wait(max(timeout_s, 0.0)):
                self._result = ReadResult(False, "timeout", self._abandon(self._done, self._peer))
            elif self._out.get("status") == 0:
                self._result = ReadResult(True, "")
            else:
                self._result = ReadResult(False, "failed")
        return self._result


def listening() -> set[str]:
    """``ip:port`` of every TCP socket this process listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = set()
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            with open(f"/proc/self/net/{name}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            col = row.split()
            if col[3] != "0A" or col[9] not in inodes:       # 0A: LISTEN
                continue
            ip_hex, port = col[1].split(":")
            out.add(f"{_ip(ip_hex, v6)}:{int(port, 16)}")
    return out


def _ip(hex_ip: str, v6: bool) -> str:
    import ipaddress
    raw = bytes.fromhex(hex_ip)
    if not v6:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return f"[{ipaddress.IPv6Address(words)}]"
