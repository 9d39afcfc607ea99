"""The owner side: serve a stored session's blocks to other nodes of the cluster (the
messages are ``wire``'s, sealed with the cluster secret).

The owner takes the store's read lease (``FlatCakeStore.read_lease``) on the run before
reading it and keeps it until the ack or the lease's end, so reclaim cannot take the session
while a requester pulls it; a session reclaimed before that is a clean miss ("not stored").

No message can stop the service: it checks size and MAC before parsing and the shape after,
answers every request it received (an error is an answer), and rolls back a grant on any
failure.  Each requester holds at most ``grants_per_peer`` grants, counted per node its
signature proves (``identity``: a member cannot sign as another); a grant's slot is
registered with the Transfer Engine only from the grant to its ack or lease end.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, FlatCakeError
from . import wire
from .directory import Directory
from .owner_read import publish_records, stage_run
from .seal import grant_cipher, seal_block, sealed_bytes
from .secret import ClusterSecret
from .transfer import Engine, check_host

log = logging.getLogger("sglang_flatcake")


@dataclass
class _Lease:
    id: str
    peer: int              # the requester it was granted to (the node its signature proves)
    slot: int
    addr: int              # the slot's registration
    keys: list[str]
    expires: float
    pin: object            # the store's ReadLease: its sessions stay pinned until release


class OwnerService:
    """Serves ``store``'s blocks through ``engine`` to nodes holding ``secret``.  ``publish``
    records what a tenant may fetch (with the writer's records) and tells the directory;
    ``sweep`` drops entries of sessions the store reclaimed.

    Owns the staging region (``slots`` slots of ``slot_blocks`` blocks, never registered at
    rest) and the REP socket thread; ``close`` stops both (the store stays the caller's)."""

    def __init__(self, store, engine: Engine, secret: ClusterSecret,
                 directory: Directory | None = None, host: str = "127.0.0.1", port: int = 0,
                 slots: int = 4, slot_blocks: int = 256, lease_s: float = 2.0,
                 grants_per_peer: int = 2) -> None:
        import zmq
        if slots < 1 or slot_blocks < 1 or grants_per_peer < 1:
            raise ConfigError(f"slots={slots!r}, slot_blocks={slot_blocks!r}, grants_per_peer="
                              f"{grants_per_peer!r}: each must be >= 1")
        if lease_s <= 0:
            raise ConfigError(f"lease_s={lease_s!r} is not allowed: expected > 0")
        self.store, self.engine, self.directory = store, engine, directory
        self.secret, self.node = secret, secret.identity.node     # ConfigError without one
        self.slot_blocks, self.lease_s, self.grants_per_peer = slot_blocks, lease_s, grants_per_peer
        self.staging = store.alloc_blocks(slots * slot_blocks)    # aligned for O_DIRECT
        self.sealed = np.zeros((slots * slot_blocks, sealed_bytes(store.layout.block_bytes)),
                               np.uint8)     # what peers may read, for its grant only
        self._leases: dict[int, _Lease] = {}                       # slot -> lease
        self._free = list(range(slots))
        self._tenants: dict[str, dict[str, dict[str, None]]] = {}  # tag -> session -> keys
        self._records: dict[str, dict[str, str]] = {}              # tag -> key -> record
        self._tenant_keys: dict[str, bytes] = {}                   # tag -> the tenant's key
        self._lock = threading.Lock()
        self._nonces = wire.NonceRecord()      # the serving thread's: replays are refused
        self.counters = {"requests": 0, "refused": 0, "grants": 0, "expired": 0}
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 4 * wire.MAX_MESSAGE)   # larger: dropped unread
        host = check_host(host)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fc-owner", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ what may be served
    def publish(self, tenant: str, session: str, keys: list[str]) -> None:
        """Let ``tenant`` fetch the stored leading run of ``keys`` of ``session``: record each
        block's publish-time record, then tell the directory."""
        tag = self.secret.tag(tenant)
        recs = publish_records(self.store, self.secret, tag, list(keys))
        keys = list(keys[:len(recs)])
        with self._lock:
            self._tenants.setdefault(tag, {}).setdefault(session, {}).update(dict.fromkeys(keys))
            self._records.setdefault(tag, {}).update(zip(keys, recs))
            self._tenant_keys[tag] = self.secret.tenant_key(tenant)
        if self.directory is not None and keys:
            self.directory.publish(tenant, session, keys)

    def sweep(self, tenant: str) -> list[str]:
        """Drop (here and in the directory) ``tenant``'s sessions of which the store no
        longer holds every key -- call after a reclaim.  Returns the sessions dropped."""
        tag = self.secret.tag(tenant)
        gone = []
        with self._lock:
            for session, keys in list(self._tenants.get(tag, {}).items()):
                if keys and self.store.exists(list(keys)) < len(keys):
                    gone.append(session)
                    del self._tenants[tag][session]
            live = {k for ks in self._tenants.get(tag, {}).values() for k in ks}
            recs = self._records.get(tag, {})
            self._records[tag] = {k: recs[k] for k in live if k in recs}
        for session in gone:
            if self.directory is not None:
                self.directory.remove_session(tenant, session)
        return gone

    def held(self, peer: int | None = None) -> int:
        """Grants outstanding (for ``peer``, or all)."""
        with self._lock:
            return sum(1 for l in self._leases.values() if peer is None or l.peer == peer)

    # ------------------------------------------------------------------ requests
    def _serve(self) -> None:
        import zmq
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            raw = self._sock.recv()
            peer, rep = self._answer(raw)
            self._sock.send(wire.seal(self.secret, rep) if peer is None
                            else wire.seal_to(self.secret, rep, peer))

    def _answer(self, raw: bytes) -> tuple[int | None, dict]:
        """``(proven sender or None, the reply)`` to one raw request: never raises (every
        request is answered)."""
        self.counters["requests"] += 1
        nonce, peer = "", None
        try:
            peer, req = wire.unseal_from(self.secret, raw)   # the node its signature proves
            nonce = wire.need(req, "nonce", str)[:wire.MAX_NONCE_CHARS]
            if req.get("to", self.endpoint) != self.endpoint:
                raise wire.WireError("request for another owner")
            ts = wire.fresh(req)
            if not self._nonces.admit(wire.nonce_of(req), ts, time.time()):
                raise wire.WireError("request replayed (its nonce was seen already)")
            op = wire.need(req, "op", str)
            if op == "fetch":
                rep = self._fetch(peer, wire.need(req, "tag", str),
                                  wire.keys_of(req)[:self.slot_blocks], nonce,
                                  str(req.get("proof", "")))
            elif op == "ack":
                rep = self._ack(peer, wire.need(req, "lease", str))
            else:
                raise wire.WireError(f"unknown op {op[:40]!r}")
        except wire.WireError as e:
            self.counters["refused"] += 1
            rep = {"error": f"bad request: {e}"}
        except FlatCakeError as e:      # the store refused (closed, I/O): a miss, logged
            log.warning("flatcake: owner could not serve a fetch: %s", e)
            rep = {"error": f"owner store: {e}"}
        except Exception as e:          # a bug must not stop the service: answered, logged
            log.exception("flatcake: owner request failed")
            rep = {"error": f"owner failed: {type(e).__name__}"}
        rep["re"] = nonce
        return peer, rep

    def _expire(self, now: float) -> None:
        for slot, lease in list(self._leases.items()):
            if lease.expires <= now:
                self.counters["expired"] += 1
                self._end(slot)

    def _end(self, slot: int) -> _Lease:
        """Drop ``slot``'s lease: unregister the slot, unpin the run, free the slot."""
        lease = self._leases.pop(slot)
        self.engine.unregister(lease.addr)
        lease.pin.release()
        self._free.append(slot)
        return lease

    def _fetch(self, peer: int, tag: str, keys: list[str], nonce: str, proof: str) -> dict:
        with self._lock:
            recs = self._records.get(tag, {})
            n = next((i for i, k in enumerate(keys) if k not in recs), len(keys))
            self._expire(time.monotonic())
            if n == 0:
                return {"hits": 0, "reason": "not published"}
            if not hmac.compare_digest(proof.encode(),
                                       wire.tenant_proof(self._tenant_keys[tag], nonce).encode()):
                raise wire.WireError("no proof of the tenant's key (its tag alone is not enough)")
            if not self._free or sum(l.peer == peer for l in self._leases.values()) \
                    >= self.grants_per_peer:
                return {"hits": 0, "reason": "busy"}
            slot = self._free.pop()
            records = [recs[k] for k in keys[:n]]
        pin = addr = None
        try:
            pin = self.store.read_lease(keys[:n])       # pinned until the ack or the lease ends
            at = slice(slot * self.slot_blocks, slot * self.slot_blocks + pin.n)
            aead = grant_cipher(self.secret, peer, self.node, nonce)
            got = stage_run(self.store, pin, self.staging[at], self.sealed[at],
                            lambda i, plain, out: seal_block(aead, i, tag, keys[i], plain, out))
            if got.hits == 0:
                raise _NotStored
            addr = self.engine.register(self.sealed[at][:got.hits])
            lease = _Lease(secrets.token_hex(16), peer, slot, addr, keys[:got.hits],
                           time.monotonic() + self.lease_s, pin)
            with self._lock:
                self._leases[slot] = lease
        except BaseException as e:                   # rolled back: nothing stays held
            if addr is not None:
                self.engine.unregister(addr)
            if pin is not None:
                pin.release()
            with self._lock:
                self._free.append(slot)
            if isinstance(e, _NotStored):
                return {"hits": 0, "reason": "not stored"}
            raise
        self.counters["grants"] += 1
        return {"hits": got.hits, "lease": lease.id, "peer": self.engine.session,
                "bytes": got.hits * self.sealed.shape[1], "segments": got.segments,
                "records": records[:got.hits], "memory": list(got.memory),
                "from_ssd": got.from_ssd,
                "read_commands": got.read_commands}

    def _ack(self, peer: int, lid: str) -> dict:
        with self._lock:
            self._expire(time.monotonic())
            slot = next((s for s, l in self._leases.items() if l.id == lid and l.peer == peer),
                        None)
            if slot is None:
                return {"valid": False, "reason": "lease expired"}
            lease = self._end(slot)
        stored = self.store.exists(lease.keys) == len(lease.keys)
        return {"valid": stored, "reason": "" if stored else "reclaimed"}

    def close(self) -> None:
        """Stop serving and drop every grant; a second call does nothing."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self._sock.close()
        with self._lock:
            for slot in list(self._leases):
                self._end(slot)


class _NotStored(Exception):
    """The run went between the lookup and the read (rolled back as a miss)."""
