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
import errno
import os as _os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

O_DIRECT = getattr(_os, "O_DIRECT", 0)


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


def check_commands(commands: Sequence[ReadCommand], targets: Sequence, alignment: int) -> None:
    """``submit``'s argument check: one target per command, every offset aligned."""
    if len(commands) != len(targets):
        raise ValueError("read: one buffer per command")
    for cmd in commands:
        if cmd.offset % alignment:
            raise ValueError(f"read: offset {cmd.offset} of {cmd.path} is not "
                             f"{alignment}-aligned")


def command_views(cmd: ReadCommand, target, flat) -> list[np.ndarray]:
    """The flat uint8 views (``flat(array)``) a read of ``cmd`` fills: one array, of which
    the first ``cmd.length`` bytes, or a scatter list whose sizes add up to ``cmd.length``;
    ``ValueError`` naming both sizes otherwise."""
    if isinstance(target, np.ndarray):
        if target.nbytes < cmd.length:
            raise ValueError(f"read: buffer of {target.nbytes} bytes for {cmd.length}")
        return [flat(target)[:cmd.length]]
    views = [flat(v) for v in target]
    if sum(v.nbytes for v in views) != cmd.length:
        raise ValueError(f"read: scatter list of {sum(v.nbytes for v in views)} bytes "
                         f"for a command of {cmd.length}")
    return views


class FileTable:
    """Per-path descriptors for an engine, each opened once: O_DIRECT, or buffered where the
    filesystem refuses O_DIRECT (EINVAL; the path is then counted in ``buffered``).

    ``check`` runs under the lock before a new open (an engine that is closing refuses).
    """

    def __init__(self, want_direct: bool, lock, check=None) -> None:
        self.want_direct, self.lock, self.check = want_direct, lock, check
        self.fds: dict[str, tuple[int, bool]] = {}
        self.buffered: set[str] = set()

    def get(self, path: str, create: bool = False) -> tuple[int, bool]:
        """(fd, direct) for ``path``; an open failure raises ``IOEngineError``."""
        import os

        from ..errors import IOEngineError
        got = self.fds.get(path)
        if got is not None:
            return got
        with self.lock:
            got = self.fds.get(path)
            if got is not None:
                return got
            if self.check is not None:
                self.check(path)
            from ..private_fs import open_file
            d = self.want_direct
            try:
                try:     # a new file is created O_EXCL, 0600; no open follows a symlink
                    got = (open_file(path, os.O_RDWR | (O_DIRECT if d else 0), create)[0], d)
                except OSError as e:
                    if not d or e.errno != errno.EINVAL:
                        raise
                    got = (open_file(path, os.O_RDWR, create)[0], False)
                    self.buffered.add(path)
            except OSError as e:
                raise IOEngineError(e.errno, f"open {path}: {e.strerror}") from None
            self.fds[path] = got
            return got

    def forget(self, path: str) -> None:
        """Close ``path``'s descriptor; its commands must have finished."""
        import os
        with self.lock:
            got = self.fds.pop(path, None)
            self.buffered.discard(path)
        if got is not None:
            os.close(got[0])

    def take_all(self) -> list[int]:
        """Every open descriptor, removed from the table (for ``close``)."""
        with self.lock:
            fds = [fd for fd, _ in self.fds.values()]
            self.fds.clear()
        return fds


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
