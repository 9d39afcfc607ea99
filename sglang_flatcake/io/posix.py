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
from typing import Callable, Sequence

import numpy as np

from ..errors import IOEngineError
from ..layout import align_down, align_up
from .base import (O_DIRECT, FileTable, IOEngine, ReadCommand, aligned_empty, check_commands,
                   command_views, datasync, fallocate_to)

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class ReadHandle:
    """One submitted command; ``wait`` returns when all its chunks are done."""

    def __init__(self, futures, count: Callable[[str], None]) -> None:
        self._futures = futures
        self._count = count                  # the engine's stats counter

    def wait(self) -> None:
        """Block until done; raise ``IOEngineError`` if any chunk failed."""
        first = None
        for f in self._futures:  # wait for all: the buffers stay ours until then
            exc = f.exception()
            if exc is not None and first is None:
                first = exc
        if first is not None:
            self._count("errors")
            raise first


class PosixEngine(IOEngine):
    name = "posix"

    def __init__(self, alignment: int = 4096, threads: int = 4,
                 max_io_bytes: int = 4 << 20, direct: bool = True) -> None:
        super().__init__(alignment)
        self.threads = threads
        self.max_io_bytes = max(alignment, align_down(max_io_bytes, alignment))
        self.want_direct = direct and O_DIRECT != 0
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="flatcake-io")
        self._lock = threading.Lock()
        self._files = FileTable(self.want_direct, self._lock)
        self._local = threading.local()
        self._stats = {"read_commands": 0, "read_ops": 0, "bytes_read": 0,
                       "write_ops": 0, "bytes_written": 0, "bounce_ops": 0, "errors": 0}

    # -- files -----------------------------------------------------------
    def _fd(self, path: str, create: bool = False) -> tuple[int, bool]:
        return self._files.get(path, create)

    def forget(self, path: str) -> None:
        self._files.forget(path)

    def is_direct(self, path: str) -> bool:
        return self._fd(path)[1]

    def _bounce(self, nbytes: int) -> np.ndarray:
        buf = getattr(self._local, "bounce", None)
        if buf is None or buf.nbytes < nbytes:
            buf = aligned_empty(align_up(max(nbytes, 1 << 20), self.alignment), self.alignment)
            self._local.bounce = buf
        return buf[:nbytes]

    # -- reads -----------------------------------------------------------
    def _read_chunk(self, fd: int, direct: bool, path: str, offset: int,
                    iov: list[np.ndarray]) -> None:
        """Read ``sum(len(iov))`` bytes at ``offset`` scattered over ``iov``."""
        n = sum(v.nbytes for v in iov)
        a = self.alignment
        ok = (not direct) or all(v.ctypes.data % a == 0 and v.nbytes % a == 0 for v in iov)
        try:
            if ok:
                self._preadv_full(fd, [memoryview(v) for v in iov], offset, path)
                return
            # unaligned piece(s) under O_DIRECT: aligned body direct, the rest via the bounce buffer
            if len(iov) == 1 and iov[0].ctypes.data % a == 0 and n >= a:
                body = n // a * a
                self._preadv_full(fd, [memoryview(iov[0][:body])], offset, path)
                rest, roff = iov[0][body:], offset + body
                parts = [rest]
            else:
                parts, roff = iov, offset
            need = sum(v.nbytes for v in parts)
            bounce = self._bounce(align_up(need, a))
            got = self._preadv_full(fd, [memoryview(bounce)], roff, path, allow_short=True)
            if got < need:
                raise IOEngineError(errno.EIO, f"short read of {path} at {roff}: "
                                    f"{got} of {need} bytes (file too small)")
            pos = 0
            for v in parts:
                v[...] = bounce[pos:pos + v.nbytes].reshape(v.shape)
                pos += v.nbytes
            self._count("bounce_ops")
        except OSError as e:
            if isinstance(e, IOEngineError):
                raise
            raise IOEngineError(e.errno, f"read {path} at {offset}: {e.strerror}") from None

    def _count(self, name: str, k: int = 1) -> None:
        with self._lock:
            self._stats[name] += k

    def _preadv_full(self, fd: int, mvs: list[memoryview], offset: int, path: str,
                     allow_short: bool = False) -> int:
        want = sum(m.nbytes for m in mvs)
        done = 0
        ops = 0
        while done < want:
            # skip the iovecs already filled
            skip, rest = done, []
            for m in mvs:
                if skip >= m.nbytes:
                    skip -= m.nbytes
                    continue
                rest.append(m[skip:] if skip else m)
                skip = 0
            got = os.preadv(fd, rest[:IOV_MAX], offset + done)
            ops += 1
            if got == 0:
                if allow_short:
                    break
                raise IOEngineError(errno.EIO, f"short read of {path} at {offset}: "
                                    f"{done} of {want} bytes (file too small)")
            done += got
        self._count("read_ops", ops)
        return done

    def _chunks(self, target) -> list[list[np.ndarray]]:
        """Cut a target (one buffer or a scatter list) into iovec lists of at most
        ``max_io_bytes`` and ``IOV_MAX`` entries."""
        views = [target] if isinstance(target, np.ndarray) else list(target)
        out: list[list[np.ndarray]] = [[]]
        size = 0
        for v in views:
            v = v.reshape(-1).view(np.uint8)
            while v.nbytes:
                room = self.max_io_bytes - size
                if room <= 0 or len(out[-1]) >= IOV_MAX:
                    out.append([])
                    size, room = 0, self.max_io_bytes
                take = v[:room]
                out[-1].append(take)
                size += take.nbytes
                v = v[take.nbytes:]
        return [c for c in out if c]

    def submit(self, commands: Sequence[ReadCommand], buffers: Sequence) -> list[ReadHandle]:
        """Start every command now; returns one handle per command, in order.

        ``buffers[i]`` is one array, or a list of arrays that the command's bytes
        are scattered over in order (a vectored read straight into place).
        """
        check_commands(commands, buffers, self.alignment)
        handles = []
        for cmd, target in zip(commands, buffers):
            target = command_views(cmd, target, lambda v: v.reshape(-1).view(np.uint8))
            fd, direct = self._fd(cmd.path)
            off = cmd.offset
            futures = []
            for iov in self._chunks(target):
                futures.append(self._pool.submit(self._read_chunk, fd, direct, cmd.path, off, iov))
                off += sum(v.nbytes for v in iov)
            handles.append(ReadHandle(futures, self._count))
        self._count("read_commands", len(commands))
        self._count("bytes_read", sum(c.length for c in commands))
        return handles

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
                self._count("write_ops")
            if body < n:
                tail = n - body
                bounce = self._bounce(align_up(tail, self.alignment))
                bounce[:tail] = data[body:]
                bounce[tail:] = 0
                mv = memoryview(bounce)
                done = 0
                while done < bounce.nbytes:
                    done += os.pwritev(fd, [mv[done:]], offset + body + done)
                    self._count("write_ops")
                self._count("bounce_ops")
        except OSError as e:
            self._count("errors")
            raise IOEngineError(e.errno, f"write {path} at {offset}: {e.strerror}") from None
        self._count("bytes_written", n)

    def allocate(self, path: str, size: int) -> None:
        fallocate_to(self._fd(path, create=True)[0], path, size)

    def sync(self, path: str) -> None:
        datasync(self._fd(path)[0], path)

    def stats(self) -> dict:
        return {"engine": self.name, "threads": self.threads, "direct": self.want_direct,
                "buffered_files": len(self._files.buffered), **self._stats}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for fd in self._files.take_all():
            try:
                os.close(fd)
            except OSError:
                pass
