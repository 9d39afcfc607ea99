"""The I/O engine interface shared by the POSIX, io_uring and kvikio engines.

Contract:
- ``submit(commands, targets)`` starts every command and returns one handle per
  command; ``handle.wait()`` returns when that command is done or raises
  ``IOEngineError`` naming the file and offset.  ``targets[i]`` is one buffer
  (filled from its start) or a list of buffers the command's bytes are
  scattered over in order (a vectored read straight into place).  The targets
  belong to the engine until ``wait`` returns.  Nothing waits forever: a failed
  chunk fails its command.
- ``read(commands, targets)`` is ``submit`` then ``wait`` on every handle; after
  a failure it still waits for the rest, then raises the first error.
- ``write(path, offset, data)`` writes all of ``data`` at ``offset`` (aligned)
  or raises; an unaligned tail goes through a zero-padded bounce buffer.
- ``allocate(path, size)`` makes the file at least ``size`` bytes with real
  blocks behind them (fallocate); a full disk raises ``IOEngineError`` with
  ``errno == ENOSPC``.
- Buffers from ``alloc`` are aligned to ``alignment``; offsets must be aligned.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class ReadCommand:
    """Read ``length`` bytes of ``path`` at ``offset``."""

    path: str
    offset: int
    length: int


def aligned_empty(nbytes: int, alignment: int = 4096) -> np.ndarray:
    """An uninitialised uint8 array of ``nbytes`` whose address is aligned."""
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    skip = (-raw.ctypes.data) % alignment
    return raw[skip:skip + nbytes]


def fallocate_to(fd: int, path: str, size: int) -> None:
    """Grow an open file to at least ``size`` bytes with real blocks behind them."""
    import os

    from ..errors import IOEngineError
    try:
        cur = os.fstat(fd).st_size
        if size > cur:
            os.posix_fallocate(fd, cur, size - cur)
    except OSError as e:
        raise IOEngineError(e.errno, f"fallocate {path} to {size} bytes: "
                            f"{os.strerror(e.errno)}") from None


def datasync(fd: int, path: str) -> None:
    """fdatasync an open file, failing with ``IOEngineError``."""
    import os

    from ..errors import IOEngineError
    try:
        os.fdatasync(fd)
    except OSError as e:
        raise IOEngineError(e.errno, f"fdatasync {path}: {e.strerror}") from None


class IOEngine(abc.ABC):
    name: str = "base"

    def __init__(self, alignment: int = 4096) -> None:
        self.alignment = alignment

    def alloc(self, nbytes: int) -> np.ndarray:
        """An aligned buffer the engine can read into directly."""
        return aligned_empty(nbytes, self.alignment)

    @abc.abstractmethod
    def submit(self, commands: Sequence[ReadCommand], targets: Sequence) -> list: ...

    def read(self, commands: Sequence[ReadCommand], targets: Sequence) -> None:
        first = None
        for h in self.submit(commands, targets):
            try:
                h.wait()
            except Exception as e:  # keep waiting: the other targets are still being filled
                first = first or e
        if first is not None:
            raise first

    @abc.abstractmethod
    def write(self, path: str, offset: int, data: np.ndarray) -> None: ...

    @abc.abstractmethod
    def allocate(self, path: str, size: int) -> None: ...

    @abc.abstractmethod
    def sync(self, path: str) -> None: ...

    @abc.abstractmethod
    def forget(self, path: str) -> None:
        """Close whatever the engine holds open for ``path`` (before it is deleted)."""

    @abc.abstractmethod
    def stats(self) -> dict: ...

    def close(self) -> None:
        """Release threads and file descriptors; the engine is unusable afterwards."""
