"""The requester side: restore a remote owner's blocks, or miss within a bound.

``fetch`` asks the owner's service for the leading run of ``keys``, pulls the staged bytes
with one Transfer Engine read into a registered receive buffer, verifies every
(block, layer) against the owner's xxh3_64 checksums, acks, and only then copies the
verified leading run into ``out``.  Every step shares one deadline (``timeout_s``): a dead,
slow or partitioned owner is ``RemoteResult(hits=0, reason=...)`` by then, never a hang, and
``out`` is untouched unless ``hits > 0``.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import xxhash

from ..errors import ConfigError
from ..layout import KVLayout
from .transfer import Engine


@dataclass(frozen=True)
class RemoteResult:
    hits: int                  # leading blocks restored into ``out`` and verified
    bytes: int                 # bytes moved by the Transfer Engine
    seconds: float
    reason: str = ""           # why fewer than asked: "owner timeout", "transfer timeout",
                               # "checksum", "reclaimed", "lease expired", the owner's reason
    owner_read_commands: int = 0


class RemoteReader:
    """Fetches from remote owners through ``engine``.  Owns one registered receive buffer
    of ``max_blocks`` blocks; a buffer a late transfer may still write is set aside (kept
    alive, never reused) and a fresh one registered."""

    def __init__(self, engine: Engine, layout: KVLayout, max_blocks: int = 256,
                 timeout_s: float = 1.0) -> None:
        import zmq
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s={timeout_s!r} is not allowed: expected > 0 seconds")
        if max_blocks < 1:
            raise ConfigError(f"max_blocks={max_blocks!r} is not allowed: expected >= 1")
        self.engine, self.layout = engine, layout
        self.max_blocks, self.timeout_s = max_blocks, timeout_s
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._set_aside: list[tuple[np.ndarray, threading.Event]] = []
        self._new_buffer()

    def _new_buffer(self) -> None:
        self._set_aside = [(b, e) for b, e in self._set_aside if not e.is_set()]
        self.buf = np.zeros((self.max_blocks, self.layout.layers, self.layout.block_layer_bytes),
                            np.uint8)
        self.buf_addr = self.engine.register(self.buf)

    def _call(self, endpoint: str, msg: dict, deadline: float) -> dict | None:
        """One request/reply within the deadline; ``None`` when the owner did not answer."""
        zmq = self._zmq
        s = self._ctx.socket(zmq.REQ)
        s.setsockopt(zmq.LINGER, 0)
        try:
            s.connect(endpoint)
            s.send(json.dumps(msg).encode())
            left = deadline - time.monotonic()
            if left <= 0 or not s.poll(int(left * 1000) + 1, zmq.POLLIN):
                return None
            return json.loads(s.recv())
        finally:
            s.close()

    def fetch(self, endpoint: str, tenant: str, keys: Sequence[str], out: np.ndarray,
              on_grant: Callable[[dict], None] | None = None) -> RemoteResult:
        """Restore the leading run of ``keys`` (at most ``max_blocks``) held by the owner at
        ``endpoint`` into ``out`` (``(n, layers, block_layer_bytes)`` uint8).  ``on_grant``
        (tests, tracing) sees the owner's grant before the transfer starts."""
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        want = out.reshape(-1, self.layout.layers, self.layout.block_layer_bytes)
        if want.shape[0] < min(len(keys), self.max_blocks):
            raise ValueError(f"out holds {want.shape[0]} blocks for {len(keys)} keys")

        def miss(reason: str, moved: int = 0) -> RemoteResult:
            return RemoteResult(0, moved, time.monotonic() - t0, reason)

        grant = self._call(endpoint, {"op": "fetch", "tenant": tenant,
                                      "keys": list(keys[: self.max_blocks])}, deadline)
        if grant is None:
            return miss("owner timeout")
        if grant.get("error") or not grant.get("hits"):
            return miss(grant.get("error") or grant.get("reason", "miss"))
        n, nbytes = int(grant["hits"]), int(grant["bytes"])
        if n > min(len(keys), self.max_blocks) or nbytes != n * self.layout.block_bytes:
            return miss("bad grant")
        if on_grant is not None:
            on_grant(grant)
        r = self.engine.read(grant["peer"], [self.buf_addr], [int(grant["addr"])], [nbytes],
                             deadline - time.monotonic())
        if not r.ok:
            if r.quarantined is not None:
                self._set_aside.append((self.buf, r.quarantined))
                self._new_buffer()
            return miss("transfer " + r.reason)
        h = xxhash.xxh3_64_intdigest
        sums = grant["checksums"]
        good = 0
        for i in range(n):
            if any(h(self.buf[i, j]) != int(sums[i][j]) for j in range(self.layout.layers)):
                break
            good += 1
        ack = self._call(endpoint, {"op": "ack", "lease": grant["lease"]}, deadline)
        if ack is None:
            return miss("owner timeout", nbytes)
        if not ack.get("valid"):
            return miss(ack.get("reason", "invalid"), nbytes)
        if good == 0:
            return miss("checksum", nbytes)
        want[:good] = self.buf[:good]
        return RemoteResult(good, nbytes, time.monotonic() - t0,
                            "" if good == n else "checksum", int(grant.get("read_commands", 0)))
