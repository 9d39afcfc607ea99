"""POSIX engine: O_DIRECT preadv/pwritev on a thread pool.

Each command is cut into chunks of at most ``max_io_bytes`` that run on
``threads`` workers, so several reads are in flight.  Where the filesystem
refuses O_DIRECT (tmpfs) the file is opened buffered instead; ``stats()``
counts those files under ``buffered_files``.
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from ..errors import IOEngineError
from ..layout import align_down, align_up
from .base import IOEngine, ReadCommand, aligned_empty

O_DIRECT = getattr(os, "O_DIRECT", 0)


class PosixEngine(IOEngine):
    name = "posix"

    def __init__(self, alignment: int = 4096, threads: int = 4,
                 max_io_bytes: int = 8 << 20, direct: bool = True) -> None:
        super().__init__(alignment)
        self.threads = threads
        self.max_io_bytes = max(alignment, align_down(max_io_bytes, alignment))
        self.want_direct = direct and O_DIRECT != 0
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="flatcake-io")
        self._fds: dict[str, tuple[int, bool]] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._stats = {"read_commands": 0, "read_ops": 0, "bytes_read": 0,
                       "write_ops": 0, "bytes_written": 0, "bounce_ops": 0, "errors": 0}
        self._buffered: set[str] = set()

    # -- files -----------------------------------------------------------
    def _fd(self, path: str, create: bool = False) -> tuple[int, bool]:
        with self._lock:
            got = self._fds.get(path)
            if got is not None:
                return got
            flags = os.O_RDWR | (os.O_CREAT if create else 0)
            direct = False
            fd = -1
            if self.want_direct:
                try:
                    fd = os.open(path, flags | O_DIRECT, 0o644)
                    direct = True
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise IOEngineError(e.errno, f"open {path}: {e.strerror}") from None
            if fd < 0:
                try:
                    fd = os.open(path, flags, 0o644)
                except OSError as e:
                    raise IOEngineError(e.errno, f"open {path}: {e.strerror}") from None
                if self.want_direct:
                    self._buffered.add(path)
            self._fds[path] = (fd, direct)
            return fd, direct

    def forget(self, path: str) -> None:
        with self._lock:
            got = self._fds.pop(path, None)
            self._buffered.discard(path)
        if got is not None:
            os.close(got[0])

    def is_direct(self, path: str) -> bool:
        return self._fd(path)[1]

    def _bounce(self, nbytes: int) -> np.ndarray:
        buf = getattr(self._local, "bounce", None)
        if buf is None or buf.nbytes < nbytes:
            buf = aligned_empty(align_up(max(nbytes, 1 << 20), self.alignment), self.alignment)
            self._local.bounce = buf
        return buf[:nbytes]

    # -- reads -----------------------------------------------------------
    def _read_chunk(self, fd: int, direct: bool, path: str, offset: int, dest: np.ndarray) -> None:
        n = dest.nbytes
        aligned_buf = dest.ctypes.data % self.alignment == 0
        body = align_down(n, self.alignment) if (direct and aligned_buf) else (0 if direct else n)
        try:
            if body:
                self._pread_full(fd, memoryview(dest[:body]), offset, path)
            if body < n:  # unaligned tail (or unaligned buffer): through the bounce buffer
                tail = n - body
                bounce = self._bounce(align_up(tail, self.alignment))
                got = self._pread_full(fd, memoryview(bounce), offset + body, path, allow_short=True)
                if got < tail:
                    raise IOEngineError(errno.EIO, f"short read of {path} at {offset + body}: "
                                        f"{got} of {tail} bytes (file too small)")
                dest[body:] = bounce[:tail]
                self._stats["bounce_ops"] += 1
        except OSError as e:
            if isinstance(e, IOEngineError):
                raise
            raise IOEngineError(e.errno, f"read {path} at {offset}: {e.strerror}") from None

    def _pread_full(self, fd: int, mv: memoryview, offset: int, path: str,
                    allow_short: bool = False) -> int:
        done = 0
        while done < mv.nbytes:
            got = os.preadv(fd, [mv[done:]], offset + done)
            self._stats["read_ops"] += 1
            if got == 0:
                if allow_short:
                    return done
                raise IOEngineError(errno.EIO, f"short read of {path} at {offset}: "
                                    f"{done} of {mv.nbytes} bytes (file too small)")
            done += got
        return done

    def read(self, commands: Sequence[ReadCommand], buffers: Sequence[np.ndarray]) -> None:
        if len(commands) != len(buffers):
            raise ValueError("read: one buffer per command")
        futures = []
        for cmd, buf in zip(commands, buffers):
            if cmd.offset % self.alignment:
                raise ValueError(f"read: offset {cmd.offset} of {cmd.path} is not "
                                 f"{self.alignment}-aligned")
            if buf.nbytes < cmd.length:
                raise ValueError(f"read: buffer of {buf.nbytes} bytes for {cmd.length}")
            fd, direct = self._fd(cmd.path)
            view = buf.reshape(-1).view(np.uint8)
            for start in range(0, cmd.length, self.max_io_bytes):
                end = min(cmd.length, start + self.max_io_bytes)
                futures.append(self._pool.submit(self._read_chunk, fd, direct, cmd.path,
                                                 cmd.offset + start, view[start:end]))
            self._stats["read_commands"] += 1
            self._stats["bytes_read"] += cmd.length
        first: BaseException | None = None
        for f in futures:  # wait for all, even after a failure: buffers stay owned by us
            exc = f.exception()
            if exc is not None and first is None:
                first = exc
        if first is not None:
            self._stats["errors"] += 1
            raise first

    # -- writes ----------------------------------------------------------
    def write(self, path: str, offset: int, data: np.ndarray) -> None:
        if offset % self.alignment:
            raise ValueError(f"write: offset {offset} of {path} is not {self.alignment}-aligned")
        fd, direct = self._fd(path, create=True)
        data = data.reshape(-1).view(np.uint8)
        n = data.nbytes
        aligned_buf = data.ctypes.data % self.alignment == 0
        body = align_down(n, self.alignment) if (aligned_buf or not direct) else 0
        if not direct:
            body = n
        try:
            done = 0
            mv = memoryview(data[:body])
            while done < body:
                done += os.pwritev(fd, [mv[done:]], offset + done)
                self._stats["write_ops"] += 1
            if body < n:
                tail = n - body
                bounce = self._bounce(align_up(tail, self.alignment))
                bounce[:tail] = data[body:]
                bounce[tail:] = 0
                mv = memoryview(bounce)
                done = 0
                while done < bounce.nbytes:
                    done += os.pwritev(fd, [mv[done:]], offset + body + done)
                    self._stats["write_ops"] += 1
                self._stats["bounce_ops"] += 1
        except OSError as e:
            self._stats["errors"] += 1
            raise IOEngineError(e.errno, f"write {path} at {offset}: {e.strerror}") from None
        self._stats["bytes_written"] += n

    def allocate(self, path: str, size: int) -> None:
        fd, _ = self._fd(path, create=True)
        try:
            cur = os.fstat(fd).st_size
            if size > cur:
                os.posix_fallocate(fd, cur, size - cur)
        except OSError as e:
            raise IOEngineError(e.errno, f"fallocate {path} to {size} bytes: "
                                f"{os.strerror(e.errno)}") from None

    def sync(self, path: str) -> None:
        fd, _ = self._fd(path)
        try:
            os.fdatasync(fd)
        except OSError as e:
            raise IOEngineError(e.errno, f"fdatasync {path}: {e.strerror}") from None

    def stats(self) -> dict:
        return {"engine": self.name, "threads": self.threads, "direct": self.want_direct,
                "buffered_files": len(self._buffered), **self._stats}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            fds = list(self._fds.values())
            self._fds.clear()
        for fd, _ in fds:
            try:
                os.close(fd)
            except OSError:
                pass
