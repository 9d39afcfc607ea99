"""``RosterWatch``: a node reads the operator's roster file again when it changes.

Removing a node is deleting its line from the roster on every node; within ``every_s`` each
node trusts the new roster (``NodeIdentity.replace_roster``), so the removed node's signed
entries, requests and MACs are refused from then on, with no restart.  A change is the file's
(inode, size, mtime) differing from the last one read.  A roster that cannot be read, does
not parse or no longer lists this node with its key is refused, logged once per change, and
the last good one stays: a half-written file never empties the trust.
"""

from __future__ import annotations

import logging
import os
import threading

from ..errors import ConfigError
from .identity import NodeIdentity, read_roster

log = logging.getLogger("sglang_flatcake")


class RosterWatch:
    """Polls ``path`` every ``every_s`` on its own thread and feeds ``identity``; ``check``
    does one poll (the thread's step, and tests')."""

    def __init__(self, identity: NodeIdentity, path: str, every_s: float = 2.0) -> None:
        self.identity, self.path, self.every_s = identity, path, every_s
        self.seen = self._stamp()
        self.counts = {"roster_reloads": 0, "roster_refused": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fc-roster", daemon=True)
        self._thread.start()

    def _stamp(self):
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def check(self) -> bool:
        """Read the roster again if the file changed; True when a new one is trusted."""
        stamp = self._stamp()
        if stamp == self.seen:
            return False
        self.seen = stamp
        try:
            self.identity.replace_roster(read_roster(self.path))
        except ConfigError as e:
            self.counts["roster_refused"] += 1
            log.error("flatcake: the changed roster is refused, the last one kept: %s", e)
            return False
        self.counts["roster_reloads"] += 1
        log.info("flatcake: roster read again from %s: %d nodes", self.path,
                 len(self.identity.roster))
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.check()
            except Exception:                  # the watch outlives any one bad read
                log.exception("flatcake: roster check failed")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
