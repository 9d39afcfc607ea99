"""kvikio engine: reads straight into device memory.

GPUDirect Storage where cuFile works, kvikio's compatibility mode (POSIX reads
through a pinned bounce buffer, then a copy to the device) otherwise; kvikio
picks, or ``compat_mode`` forces one.  ``alloc`` returns aligned *device*
buffers (cupy); ``submit`` also accepts host buffers.  kvikio and cupy are
imported when the engine is built, never at module import, and both need a
CUDA driver (``kvikio_usable`` says whether this process has one).

kvikio's thread pool and task size are process-wide: building an engine sets
them (``threads``, ``task_size``) for every kvikio user in the process.
"""

from __future__ import annotations

import errno
import importlib
import os
import threading
from typing import Callable, Sequence

from ..errors import IOEngineError
from ..private_fs import open_file
from .base import IOEngine, ReadCommand, check_commands


def kvikio_usable() -> tuple[bool, str]:
    """(True, "") when kvikio and cupy import and a CUDA device answers; else (False, why)."""
    try:
        import cupy
        import kvikio  # noqa: F401  (importable is the question)
    except Exception as e:  # not installed, or a broken CUDA install
        return False, f"{type(e).__name__}: {e}"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return False, "no CUDA device"
    except Exception as e:  # no driver: cudaErrorInsufficientDriver and friends
        return False, f"CUDA unavailable: {e}"
    return True, ""


def _address(a) -> int:
    return a.data.ptr if hasattr(a, "__cuda_array_interface__") else a.ctypes.data


class KvikioHandle:
    """One submitted command: one kvikio future per target buffer."""

    def __init__(self, parts: list, count: Callable[[str], None]) -> None:
        self._parts = parts          # (future, nbytes, path, file offset)
        self._count = count          # the engine's stats counter

    def done(self) -> bool:
        return all(f.done() for f, *_ in self._parts)

    def wait(self) -> None:
        """Block until every part is done; raise ``IOEngineError`` for the first failure."""
        first = None
        for fut, n, path, off in self._parts:   # wait for all: the buffers stay ours until then
            try:
                got = fut.get()
            except Exception as e:  # kvikio raises RuntimeError with the OS or CUDA reason
                short = "EOF" in str(e) or "short" in str(e)
                err = IOEngineError(errno.EIO, f"{'short read' if short else 'kvikio read'} of "
                                    f"{path} at {off}: {e}")
            else:
                if got == n:
                    continue
                err = IOEngineError(errno.EIO, f"short read of {path} at {off}: {got} of {n} "
                                    "bytes (file too small)")
            first = first or err
        if first is not None:
            self._count("errors")
            raise first


class KvikioEngine(IOEngine):
    name = "kvikio"

    def __init__(self, alignment: int = 4096, threads: int = 4, task_size: int = 4 << 20,
                 compat_mode: str | None = None, kvikio_module=None, array_module=None) -> None:
        """``compat_mode``: None (kvikio's default, AUTO), "on", "off" or "auto".

        ``kvikio_module``/``array_module`` replace ``kvikio``/``cupy`` (tests on CPU).
        Raises ``IOEngineError`` when kvikio or cupy cannot be imported.
        """
        super().__init__(alignment)
        try:
            self._kv = kvikio_module or importlib.import_module("kvikio")
            # ``import kvikio`` does not load ``kvikio.defaults`` (kvikio 26.10)
            self._defaults = (self._kv.defaults if kvikio_module is not None
                              else importlib.import_module("kvikio.defaults"))
            self._xp = array_module or importlib.import_module("cupy")
        except ImportError as e:
            raise IOEngineError(errno.ENOSYS, f"kvikio engine needs kvikio and cupy: {e}") from None
        settings = {"num_threads": threads, "task_size": task_size}
        if compat_mode is not None:
            if compat_mode.lower() not in ("on", "off", "auto"):
                raise ValueError(f"compat_mode={compat_mode!r} is not allowed: on, off or auto")
            settings["compat_mode"] = getattr(self._kv.CompatMode, compat_mode.upper())
        self._defaults.set(settings)
        self.threads, self.task_size = threads, task_size
        self._files: dict[tuple[str, str], object] = {}
        self._lock = threading.Lock()
        self._stats = {"read_commands": 0, "read_ops": 0, "bytes_read": 0, "write_ops": 0,
                       "bytes_written": 0, "bounce_ops": 0, "errors": 0}

    def alloc(self, nbytes: int):
        """An uninitialised device buffer of ``nbytes`` whose address is ``alignment``-aligned."""
        raw = self._xp.empty(nbytes + self.alignment, dtype=self._xp.uint8)
        skip = (-_address(raw)) % self.alignment
        return raw[skip:skip + nbytes]

    def _file(self, path: str, mode: str):
        with self._lock:
            f = self._files.get((path, mode))
            if f is None:
                try:
                    if mode == "r+" and not os.path.exists(path):
                        os.close(open_file(path, os.O_RDWR, create=True)[0])
                    f = self._kv.CuFile(path, mode)
                except OSError as e:
                    raise IOEngineError(e.errno, f"open {path}: {e.strerror}") from None
                except RuntimeError as e:  # kvikio reports open failures as RuntimeError
                    code = errno.ENOENT if not os.path.exists(path) else errno.EIO
                    raise IOEngineError(code, f"open {path}: {e}") from None
                self._files[(path, mode)] = f
            return f

    def _count(self, name: str, k: int = 1) -> None:
        with self._lock:
            self._stats[name] += k

    def submit(self, commands: Sequence[ReadCommand], targets: Sequence) -> list[KvikioHandle]:
        """Start every command now (kvikio splits each into ``task_size`` tasks on its pool).

        ``targets[i]`` is one buffer (device or host) or a list of buffers filled in order.
        """
        check_commands(commands, targets, self.alignment)
        handles = []
        for cmd, target in zip(commands, targets):
            views = [target] if hasattr(target, "nbytes") else list(target)
            views = [v.reshape(-1).view("uint8") for v in views]
            if len(views) == 1 and views[0].nbytes >= cmd.length:
                views = [views[0][:cmd.length]]
            if sum(v.nbytes for v in views) != cmd.length:
                raise ValueError(f"read: target of {sum(v.nbytes for v in views)} bytes for a "
                                 f"command of {cmd.length}")
            f = self._file(cmd.path, "r")
            parts, off = [], cmd.offset
            for v in views:
                parts.append((f.pread(v, v.nbytes, off), v.nbytes, cmd.path, off))
                off += v.nbytes
            self._count("read_ops", len(parts))
            handles.append(KvikioHandle(parts, self._count))
        self._count("read_commands", len(commands))
        self._count("bytes_read", sum(c.length for c in commands))
        return handles

    def write(self, path: str, offset: int, data) -> None:
        """Write all of ``data`` (host or device) at the aligned ``offset``; kvikio handles
        an unaligned tail itself."""
        if offset % self.alignment:
            raise ValueError(f"write: offset {offset} of {path} is not {self.alignment}-aligned")
        data = data.reshape(-1).view("uint8")
        f = self._file(path, "r+")
        try:
            got = f.pwrite(data, data.nbytes, offset).get()
        except RuntimeError as e:
            self._count("errors")
            raise IOEngineError(errno.EIO, f"write {path} at {offset}: {e}") from None
        if got != data.nbytes:
            self._count("errors")
            raise IOEngineError(errno.EIO, f"short write to {path} at {offset}: {got} of "
                                f"{data.nbytes} bytes")
        self._count("write_ops")
        self._count("bytes_written", data.nbytes)

    def allocate(self, path: str, size: int) -> None:
        try:
            fd = open_file(path, os.O_RDWR, create=True)[0]
            try:
                cur = os.fstat(fd).st_size
                if size > cur:
                    os.posix_fallocate(fd, cur, size - cur)
            finally:
                os.close(fd)
        except OSError as e:
            raise IOEngineError(e.errno, f"fallocate {path} to {size} bytes: "
                                f"{os.strerror(e.errno)}") from None

    def sync(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise IOEngineError(e.errno, f"fdatasync {path}: {e.strerror}") from None

    def forget(self, path: str) -> None:
        with self._lock:
            got = [self._files.pop(k) for k in list(self._files) if k[0] == path]
        for f in got:
            f.close()

    def stats(self) -> dict:
        compat = bool(self._defaults.is_compat_mode_preferred())
        return {"engine": self.name, "threads": self.threads, "task_size": self.task_size,
                "direct": not compat, "gds": not compat, "buffered_files": 0, **self._stats}

    def close(self) -> None:
        with self._lock:
            files = list(self._files.values())
            self._files.clear()
        for f in files:
            f.close()
