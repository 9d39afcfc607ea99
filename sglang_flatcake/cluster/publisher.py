"""Tell the cluster what this node stores: one thread publishes the keys each write stored,
batched per session, and sweeps the directory after the store reclaims.

Keys are published only after ``FlatCakeStore.put`` returned (their bytes are stored), so a
lookup never names a page the owner cannot serve yet.  The directory is never called on the
writer's thread: ``note`` only queues.
"""

from __future__ import annotations

import logging
import threading

from .directory import DirectoryError

log = logging.getLogger("sglang_flatcake")


class Publisher:
    """Owns one daemon thread over ``service`` (an ``OwnerService`` with a directory).

    ``note`` (any thread) queues keys of ``(tenant, session)``; the thread publishes each
    session's queued keys in one directory call.  ``reclaimed`` (the store's reclaim
    listener) makes the thread sweep every tenant seen so far.  A directory error is logged
    and counted, and those keys stay unpublished: other nodes miss them (never wrong bytes).
    ``close`` publishes what is queued, then stops the thread."""

    def __init__(self, service) -> None:
        self.service = service
        self.counters = {"published_keys": 0, "publish_calls": 0, "swept_sessions": 0,
                         "directory_errors": 0}
        self._pending: dict[tuple[str, str], list[str]] = {}
        self._tenants: set[str] = set()
        self._sweep = False
        self._stop = False
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="fc-publish", daemon=True)
        self._thread.start()

    def note(self, tenant: str, session: str, keys: list[str]) -> None:
        """Queue ``keys`` (just stored) of ``session`` for ``tenant``; never blocks."""
        if not keys:
            return
        with self._lock:
            self._pending.setdefault((tenant, session), []).extend(keys)
            self._idle.clear()
        self._wake.set()

    def reclaimed(self, sids=()) -> None:
        """The store freed sessions: sweep the directory (on the thread)."""
        with self._lock:
            self._sweep = True
            self._idle.clear()
        self._wake.set()

    def wait_idle(self, timeout: float) -> bool:
        """Block until everything queued so far is published (tests, ``close``)."""
        return self._idle.wait(timeout)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                batch, self._pending = self._pending, {}
                sweep, self._sweep, stop = self._sweep, False, self._stop
            for (tenant, session), keys in batch.items():
                self._tenants.add(tenant)
                self._guard("publish", self.service.publish, tenant, session, keys)
                self.counters["publish_calls"] += 1
                self.counters["published_keys"] += len(keys)
            for tenant in sorted(self._tenants) if sweep else ():
                gone = self._guard("sweep", self.service.sweep, tenant)
                self.counters["swept_sessions"] += len(gone or ())
            with self._lock:
                if not self._pending and not self._sweep:
                    self._idle.set()
            if stop:
                return

    def _guard(self, what: str, fn, *args):
        try:
            return fn(*args)
        except DirectoryError as e:
            self.counters["directory_errors"] += 1
            log.warning("flatcake: cluster %s failed (other nodes miss these pages): %s", what, e)
            return None

    def close(self) -> None:
        """Publish what is queued, then stop the thread; a second call does nothing."""
        if self._stop:
            return
        with self._lock:
            self._stop = True
        self._wake.set()
        self._thread.join()
