"""The requester side: restore a remote owner's blocks, or miss within a bound.

``fetch`` asks the owner's service for the leading run of ``keys`` in chunks of
``chunk_blocks``, pipelined: two chunks move at once (one Transfer Engine read each into a
receive buffer; a chunk starts as soon as its grant arrives), the owner reads the
next into another staging slot meanwhile (at most two of its slots held), and a landed
chunk is verified on a verifier thread while the next ones move.  The owner seals every
block for this grant (``seal``: AES-GCM under a key derived from the X25519 key of this node
and the owner that signed the grant, and the request's nonce); each sealed block lands in ``landing`` and is opened with that key into
``buf`` (a tampered or foreign block does not open), then checked against the *writing
node's* record of it (``wire.block_record``: a MAC under the cluster secret over its
per-layer xxh3_64 checksums, made at publish time: the disk, the staging slot and the wire
end to end); every chunk is acked, and only then is the verified leading run copied into
``out``.

No transfer ever targets ``buf``.  The landing buffer is not reachable by peers while it is
opened: over ``tcp`` it is never registered (the engine reads into unregistered memory); over
``rdma`` it is registered for one fetch and unregistered once its last transfer has ended.
A landing buffer a late transfer may still write is set aside (at most
``MAX_SET_ASIDE_PER_PEER`` per owner, ``MAX_SET_ASIDE`` in all; beyond that a fetch from that
owner, or any fetch, is a miss until they end).

Every step shares one deadline (``timeout_s``): a dead, slow or partitioned owner is
``RemoteResult(hits=0, reason=...)`` by then, never a hang, and ``out`` is untouched unless
``hits > 0``.
"""

from __future__ import annotations

import hmac
from concurrent.futures import ThreadPoolExecutor
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import xxhash

from ..errors import ConfigError
from ..layout import KVLayout
from . import wire
from .seal import grant_cipher, open_block, sealed_bytes
from .secret import ClusterSecret
from .transfer import Engine, ReadResult
from .wire import ack_request, block_record, fetch_request


@dataclass(frozen=True)
class RemoteResult:
    hits: int                  # leading blocks restored into ``out`` and verified
    bytes: int                 # bytes moved by the Transfer Engine
    seconds: float
    reason: str = ""           # why fewer than asked: "owner timeout", "transfer timeout",
                               # "checksum", "reclaimed", "lease expired", the owner's reason
    owner_read_commands: int = 0
    grant_seconds: float = 0.0  # until the owner's grant arrived (its reads and checksums)


class RemoteReader:
    """Fetches from remote owners through ``engine``.  Owns a landing buffer of
    ``max_blocks`` sealed blocks and ``buf``, the blocks opened from it; a landing buffer a
    late transfer may still write is set aside (kept alive, never reused) and a fresh one
    made."""

    MAX_SET_ASIDE = 8             # landing buffers a late transfer may still write, in all
    MAX_SET_ASIDE_PER_PEER = 1    # ... per owner: stalled peers stop only their own restores

    def __init__(self, engine: Engine, layout: KVLayout, secret: ClusterSecret,
                 max_blocks: int = 256, timeout_s: float = 1.0, chunk_blocks: int = 0) -> None:
        import zmq
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s={timeout_s!r} is not allowed: expected > 0 seconds")
        if max_blocks < 1:
            raise ConfigError(f"max_blocks={max_blocks!r} is not allowed: expected >= 1")
        if chunk_blocks < 0:
            raise ConfigError(f"chunk_blocks={chunk_blocks!r} is not allowed: 0 (one chunk) "
                              f"or a positive block count")
        self.chunk_blocks = chunk_blocks or max_blocks
        self.engine, self.layout, self.secret = engine, layout, secret
        self.node = secret.identity.node          # ConfigError without one
        self.max_blocks, self.timeout_s = max_blocks, timeout_s
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._idle: dict[str, list] = {}          # endpoint -> REQ sockets ready to send
        self._owners: dict[str, int] = {}         # endpoint -> the node a reply proved there
        self._verifier = ThreadPoolExecutor(1, thread_name_prefix="fc-verify")
        self._set_aside: list[tuple[np.ndarray, list[threading.Event], str]] = []
        self.sealed_bytes = sealed_bytes(layout.block_bytes)
        self.buf = np.zeros((max_blocks, layout.layers, layout.block_layer_bytes), np.uint8)
        self._new_buffer()

    def _new_buffer(self) -> None:
        """A fresh landing buffer (sealed blocks as they come off the wire; ``buf`` holds
        only what was opened from it with the grant's key, and no transfer targets it)."""
        self._prune()
        self.landing = np.zeros((self.max_blocks, self.sealed_bytes), np.uint8)
        self.landing_addr = self.landing.ctypes.data

    def _prune(self) -> None:
        """Forget set-aside buffers whose late transfers have all ended."""
        keep = []
        for b, ev, peer in self._set_aside:
            if all(e.is_set() for e in ev):
                self.engine.unregister(b.ctypes.data)     # a no-op over tcp
            else:
                keep.append((b, ev, peer))
        self._set_aside = keep

    @property
    def set_aside(self) -> int:
        """Buffers a late transfer may still write (kept alive, never read); those whose
        transfers all ended are forgotten first."""
        self._prune()
        return len(self._set_aside)

    def _send(self, endpoint: str, msg: dict):
        """Send ``msg`` on an idle socket to ``endpoint`` (one kept from an answered call, or
        a new one): a connection per call would cost both sides a handshake.  Signed
        (``wire.seal``) until a reply proved which node answers there, then MAC'd for that
        node alone (``wire.seal_to``: a keyed hash instead of an Ed25519 signature)."""
        idle = self._idle.get(endpoint)
        if idle:
            s = idle.pop()
        else:
            s = self._ctx.socket(self._zmq.REQ)
            s.setsockopt(self._zmq.LINGER, 0)
            s.setsockopt(self._zmq.MAXMSGSIZE, 4 * wire.MAX_MESSAGE)
            s.connect(endpoint)
        owner, msg = self._owners.get(endpoint), {**msg, "to": endpoint}
        if owner is not None and self.secret.identity.pair_key(owner) is None:
            del self._owners[endpoint]           # that node left the roster: sign again
            owner = None
        s.send(wire.seal(self.secret, msg) if owner is None
               else wire.seal_to(self.secret, msg, owner))
        return s, msg["nonce"], endpoint

    def _recv(self, call, deadline: float) -> dict | None:
        """The reply to ``call`` within the deadline (``None`` if none came; an
        ``{"error": ...}`` for one not authenticated or not answering this request), with
        ``"by"``: the node that sent it (proven).  The socket goes back to the idle ones only
        after a good answer, else it is closed."""
        s, nonce, endpoint = call
        keep = False
        try:
            left = deadline - time.monotonic()
            if left <= 0 or not s.poll(int(left * 1000) + 1, self._zmq.POLLIN):
                return None
            sender, rep = wire.unseal_from(self.secret, s.recv())
            if rep.get("re") != nonce:       # (an unauthenticated request's answer: re "")
                raise wire.WireError("reply to another request" + (
                    f" ({str(rep['error'])[:200]})" if rep.get("re") == "" and "error" in rep
                    else ""))
            keep = True
            if len(self._owners) >= 4096:
                self._owners.clear()
            self._owners[endpoint] = sender
            return {**rep, "by": sender}
        except wire.WireError as e:
            return {"error": f"bad reply: {e}", "valid": False}
        finally:
            if not keep:                     # maybe another node there now: sign again
                self._owners.pop(endpoint, None)
            if keep and len(self._idle.setdefault(endpoint, [])) < 4:
                self._idle[endpoint].append(s)
            else:
                s.close()

    def close(self) -> None:
        """Close the idle sockets (the reader stays usable: new ones open on demand)."""
        for socks in self._idle.values():
            for s in socks:
                s.close()
        self._idle.clear()

    def fetch(self, endpoint: str, tenant: str, keys: Sequence[str], out: np.ndarray | None,
              on_grant: Callable[[dict], None] | None = None,
              deadline: float | None = None) -> RemoteResult:
        """Restore the leading run of ``keys`` (at most ``max_blocks``) held by the owner at
        ``endpoint`` into ``out`` (``(n, layers, block_layer_bytes)`` uint8), or, with
        ``out=None``, leave the verified blocks in ``self.buf[:hits]`` (valid until the next
        fetch: what a server's restore scatters from, with no copy).  ``on_grant``
        (tests, tracing) sees each of the owner's grants before its transfer starts.
        ``deadline`` (``time.monotonic()``; default: now + ``timeout_s``) lets several
        fetches of one request share one bound."""
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s if deadline is None else deadline
        want = None if out is None else out.reshape(-1, self.layout.layers,
                                                     self.layout.block_layer_bytes)
        keys = list(keys[: self.max_blocks])
        if want is not None and want.shape[0] < len(keys):
            raise ValueError(f"out holds {want.shape[0]} blocks for {len(keys)} keys")
        chunks = [(i, keys[i:i + self.chunk_blocks]) for i in range(0, len(keys), self.chunk_blocks)]
        self._prune()
        if len(self._set_aside) >= self.MAX_SET_ASIDE:
            return RemoteResult(0, 0, 0.0, "too many late transfers")
        if sum(p == endpoint for _, _, p in self._set_aside) >= self.MAX_SET_ASIDE_PER_PEER:
            return RemoteResult(0, 0, 0.0, "a late transfer from this owner")
        tag, me = self.secret.tag(tenant), self.node
        tkey = self.secret.tenant_key(tenant)
        if self.engine.registers_local:        # rdma: reachable for this fetch only
            self.engine.register(self.landing)
        good, moved, reason, t_grant, cmds = 0, 0, "", 0.0, 0
        sb = self.sealed_bytes
        acks: list[list] = []       # [chunk start, socket until answered else None, answer]
        jobs, failed, flying = [], None, None   # flying: (start, n, (tag, keys, records), job, lease)

        def land(chunk) -> bool:
            """Wait for ``chunk``'s transfer and ack it (its slot is free again)."""
            nonlocal moved, failed
            r = chunk[3].wait(deadline - time.monotonic())
            if not r.ok:
                failed = r
                return False
            moved += chunk[1] * sb
            acks.append([chunk[0], self._send(endpoint, ack_request(chunk[4], me)), None])
            return True

        checks: list = []           # (start, n, future of _verified), in chunk order
        deferred: list = []         # rdma: verified once the buffer is unregistered

        def check(chunk) -> bool:
            """Queue a landed chunk's verification on the verifier thread (so the next
            chunk's grant and transfer start meanwhile); False once any queued one failed."""
            if self.engine.registers_local:
                deferred.append(chunk[:3])
                return True
            checks.append((chunk[0], chunk[1],
                           self._verifier.submit(self._verified, *chunk[:3])))
            return not any(f.done() and f.result() < n for _, n, f in checks)

        pending = self._send(endpoint, fetch_request(tag, chunks[0][1], me, tkey))
        for k, (start, ck) in enumerate(chunks):
            asked_nonce = pending[1]
            grant = self._recv(pending, deadline)
            pending = None
            if grant is None:
                reason = "owner timeout"
                break
            if grant.get("error") or not grant.get("hits"):
                reason = grant.get("error") or grant.get("reason", "miss")
                break
            fields = wire.grant_fields(grant, len(ck), sb)
            if fields is None:
                reason = "bad grant"
                break
            n, segs, records, memory = fields
            t_grant = t_grant or time.monotonic() - t0
            rc = grant.get("read_commands")
            cmds += rc if type(rc) is int else 0
            if on_grant is not None:
                on_grant(grant)
            if deadline <= time.monotonic():
                failed = ReadResult(False, "timeout")
                break
            # two transfers in flight: this chunk starts while the previous one lands
            jobs.append(self.engine.start_read(
                grant["peer"], [self.landing_addr + (start + int(s[0])) * sb for s in segs],
                [int(s[1]) for s in segs], [int(s[2]) for s in segs]))
            aead = grant_cipher(self.secret, me, grant["by"], asked_nonce)
            prev, flying = flying, (start, n, (tag, ck, records, aead, memory), jobs[-1],
                                    grant["lease"])
            if prev is not None and not land(prev):
                break
            if acks and acks[-1][1] is not None:   # the landed chunk's slot is free again
                acks[-1][1:] = [None, self._recv(acks[-1][1], deadline)]   # before a fetch
            more = k + 1 < len(chunks) and n == len(ck)
            if more:                                  # the owner reads the next chunk
                pending = self._send(endpoint, fetch_request(tag, chunks[k + 1][1], me, tkey))
            if (prev is not None and not check(prev)) or not more:
                break                                 # (verified while this one moves)
        if failed is None and flying is not None and land(flying):
            self._unexpose()              # rdma: no peer can write the buffer from here on
            check(flying)
            checks.extend((c[0], c[1], self._verifier.submit(self._verified, *c))
                          for c in deferred)
        for at, n, f in checks:      # ``good`` ends at the first bad (block, layer)
            ok = f.result()
            good = at + ok
            if ok < n:
                reason = "checksum"
                break
        if failed is not None:
            # the owner is gone or late: its leases lapse; a buffer a late transfer may
            # still write is set aside until every transfer into it has ended
            late = [e for e in (j.wait(0).quarantined for j in jobs) if e is not None]
            if late:
                self._set_aside.append((self.landing, late, endpoint))
                self._new_buffer()
            else:
                self._unexpose()
            for call in [a[1] for a in acks if a[1] is not None] + ([pending] if pending else []):
                call[0].close()
            return RemoteResult(0, moved, time.monotonic() - t0, "transfer " + failed.reason,
                                cmds, t_grant)
        if pending is not None:       # a chunk the loop stopped before: give its lease back
            late = self._recv(pending, deadline)
            if late and isinstance(late.get("lease"), str):
                self._recv(self._send(endpoint, ack_request(late["lease"], me)), deadline)
        for start, sock, ack in acks:
            ack = ack if sock is None else self._recv(sock, deadline)
            if ack is None or not ack.get("valid"):
                # that chunk's session went (or the owner did) before its bytes were
                # confirmed: it and everything after it are a miss
                if start < good:
                    good = start
                    reason = "owner timeout" if ack is None else ack.get("reason", "invalid")
        if good and want is not None:
            want[:good] = self.buf[:good]
        elif not reason:
            reason = "miss"
        return RemoteResult(good, moved, time.monotonic() - t0,
                            reason if good < len(keys) else "", cmds, t_grant)

    def _unexpose(self) -> None:
        """Unregister the landing buffer (rdma; call once every transfer into it ended)."""
        if self.engine.registers_local:
            self.engine.unregister(self.landing_addr)

    def _verified(self, start: int, n: int, asked) -> int:
        """Leading blocks of ``landing[start:start + n]`` that open with the grant's key into
        ``buf[start:start + n]`` and match the writer's records (but those the owner sealed
        straight from its arena, ``memory``: the AEAD tag covers them from there on)."""
        tag, keys, records, aead, memory = asked
        h = xxhash.xxh3_64_intdigest
        sums = np.empty(self.layout.layers, np.uint64)
        for i in range(n):
            if not open_block(aead, i, tag, keys[i], self.landing[start + i], self.buf[start + i]):
                return i
            if i in memory:
                continue
            for j in range(self.layout.layers):
                sums[j] = h(self.buf[start + i, j])
            if not hmac.compare_digest(block_record(self.secret, tag, keys[i], sums), records[i]):
                return i
        return n
