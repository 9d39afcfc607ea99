"""Named integer counters shared between threads: every change and every read under one lock.

Both modes use it (``FlatCakeStorage``'s host pool and write-once counts, the signal board,
the linker's loader, offloader, lookups and admission); a reader on another thread takes
``snapshot()``, never the dict itself.
"""

from __future__ import annotations

import threading


class Counters:
    """Named integer counters that several threads increment; each change under one lock."""

    def __init__(self, *names: str) -> None:
        self._lock = threading.Lock()
        self._values = {n: 0 for n in names}

    def add(self, name: str, n: int = 1) -> int:
        """Add ``n`` to ``name`` (a name given at construction); returns the new value."""
        with self._lock:
            self._values[name] += n
            return self._values[name]

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._values[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)
