"""The owner side: serve a stored session's blocks to other nodes (the messages are
``wire``'s).

The owner takes the store's read lease (``FlatCakeStore.read_lease``) on the run before
reading it and keeps it until the ack or the lease's end, so reclaim cannot take the session
while a requester pulls it; a session reclaimed before that is a clean miss ("not stored").
Memory-tier blocks are not copied: the grant points the requester at the store's host arena,
registered with the engine once (``owner_read``).
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass

from ..errors import ConfigError, FlatCakeError
from .directory import Directory, tenant_tag
from .transfer import Engine, check_host
from .owner_read import stage_run

log = logging.getLogger("sglang_flatcake")


@dataclass
class _Lease:
    id: int
    slot: int
    keys: list[str]
    expires: float
    pin: object            # the store's ReadLease: its sessions stay pinned until release


class OwnerService:
    """Serves ``store``'s blocks through ``engine``.  ``publish`` records what a tenant may
    fetch (and tells the directory); ``sweep`` drops entries of sessions the store reclaimed.

    Owns the staging region (``slots`` slots of ``slot_blocks`` blocks, registered once) and
    the REP socket thread; ``close`` stops both (the store stays the caller's)."""

    def __init__(self, store, engine: Engine, directory: Directory | None = None,
                 host: str = "127.0.0.1", port: int = 0, slots: int = 4,
                 slot_blocks: int = 256, lease_s: float = 2.0) -> None:
        import zmq
        if slots < 1 or slot_blocks < 1:
            raise ConfigError(f"slots={slots!r}, slot_blocks={slot_blocks!r}: both must be >= 1")
        if lease_s <= 0:
            raise ConfigError(f"lease_s={lease_s!r} is not allowed: expected > 0")
        self.store, self.engine, self.directory = store, engine, directory
        self.slot_blocks, self.lease_s = slot_blocks, lease_s
        self.staging = store.alloc_blocks(slots * slot_blocks)    # aligned for O_DIRECT
        self.staging_addr = engine.register(self.staging)
        arena = store.arena.buf        # memory-tier blocks are read from here, not copied
        self.arena_addr = engine.register(arena) if arena.nbytes else None
        self._slot_bytes = slot_blocks * store.layout.block_bytes
        self._leases: dict[int, _Lease] = {}                       # slot -> lease
        self._ids = itertools.count(1)
        self._free = list(range(slots))
        self._tenants: dict[str, dict[str, list[str]]] = {}       # tag -> session -> keys
        self._allowed: dict[str, set[str]] = {}                    # tag -> keys
        self._lock = threading.Lock()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
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
        """Let ``tenant`` fetch ``keys`` of ``session`` (already stored) and tell the directory."""
        tag = tenant_tag(tenant)
        with self._lock:
            self._tenants.setdefault(tag, {}).setdefault(session, []).extend(keys)
            self._allowed.setdefault(tag, set()).update(keys)
        if self.directory is not None:
            self.directory.publish(tenant, session, keys)

    def sweep(self, tenant: str) -> list[str]:
        """Drop (here and in the directory) ``tenant``'s sessions of which the store no
        longer holds every key -- call after a reclaim.  Returns the sessions dropped."""
        tag = tenant_tag(tenant)
        gone = []
        with self._lock:
            for session, keys in list(self._tenants.get(tag, {}).items()):
                if keys and self.store.exists(keys) < len(keys):
                    gone.append(session)
                    del self._tenants[tag][session]
            self._allowed[tag] = {k for ks in self._tenants.get(tag, {}).values() for k in ks}
        for session in gone:
            if self.directory is not None:
                self.directory.remove_session(tenant, session)
        return gone

    # ------------------------------------------------------------------ requests
    def _serve(self) -> None:
        import zmq
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            try:
                req = json.loads(self._sock.recv())
                op = req.get("op")
                rep = (self._fetch(req) if op == "fetch" else self._ack(req) if op == "ack"
                       else {"error": f"unknown op {op!r}"})
            except (ValueError, KeyError, TypeError) as e:
                rep = {"error": f"bad request: {e}"}
            except FlatCakeError as e:      # the store refused (closed, I/O): a miss, logged
                log.warning("flatcake: owner could not serve a fetch: %s", e)
                rep = {"error": f"owner store: {e}"}
            self._sock.send(json.dumps(rep).encode())

    def _expire(self, now: float) -> None:
        for slot, lease in list(self._leases.items()):
            if lease.expires <= now:
                del self._leases[slot]
                lease.pin.release()
                self._free.append(slot)

    def _fetch(self, req: dict) -> dict:
        keys = [str(k) for k in req["keys"]][: self.slot_blocks]
        tag = tenant_tag(req["tenant"])
        with self._lock:
            allowed = self._allowed.get(tag, set())
            n = next((i for i, k in enumerate(keys) if k not in allowed), len(keys))
            self._expire(time.monotonic())
            if n == 0 or not self._free:
                return {"hits": 0, "reason": "not published" if n == 0 else "busy"}
            slot = self._free.pop()
        view = self.staging[slot * self.slot_blocks: slot * self.slot_blocks + n]
        view_addr = self.staging_addr + slot * self._slot_bytes
        pin = None
        try:
            pin = self.store.read_lease(keys[:n])       # pinned until the ack or the lease ends
            got = stage_run(self.store, pin, view, view_addr, self.arena_addr)
        except FlatCakeError:
            if pin is not None:
                pin.release()
            with self._lock:
                self._free.append(slot)      # rolled back: the slot is free again
            raise
        if got.hits == 0:
            pin.release()
            with self._lock:
                self._free.append(slot)
            return {"hits": 0, "reason": "not stored"}
        lease = _Lease(next(self._ids), slot, keys[:got.hits], time.monotonic() + self.lease_s,
                       pin)
        with self._lock:
            self._leases[slot] = lease
        return {"hits": got.hits, "lease": lease.id, "peer": self.engine.session,
                "addr": view_addr, "bytes": got.hits * self.store.layout.block_bytes,
                "segments": got.segments, "from_ssd": got.from_ssd,
                "read_commands": got.read_commands, "checksums": got.checksums}

    def _ack(self, req: dict) -> dict:
        lid = int(req["lease"])
        with self._lock:
            self._expire(time.monotonic())
            slot = next((s for s, l in self._leases.items() if l.id == lid), None)
            if slot is None:
                return {"valid": False, "reason": "lease expired"}
            lease = self._leases.pop(slot)
            self._free.append(slot)
        stored = self.store.exists(lease.keys) == len(lease.keys)
        lease.pin.release()
        return {"valid": stored, "reason": "" if stored else "reclaimed"}

    def close(self) -> None:
        """Stop serving; a second call does nothing."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self._sock.close()
        with self._lock:
            for lease in self._leases.values():
                lease.pin.release()
            self._leases.clear()
