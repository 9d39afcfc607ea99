"""io_uring from Python: the raw syscalls, the structures the engine fills, and whether a
ring can be made here (``unavailable_reason``).  No state; ``uring.UringEngine`` drives it."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct

import numpy as np

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_SETUP, _ENTER, _REGISTER = 425, 426, 427              # the same on every Linux architecture
_READV, _WRITEV, _READ_FIXED, _WRITE_FIXED, _READ, _WRITE = 1, 2, 4, 5, 22, 23
_SUBMIT_ALL, _SINGLE_MMAP, _GETEVENTS, _BUFFERS2, _BUFFERS_UPDATE = 128, 1, 1, 15, 16
_SQE = struct.Struct("<BBHiQQIIQHHiQQ")                # struct io_uring_sqe, 64 bytes
_CQE = struct.Struct("<QiI")                           # struct io_uring_cqe, 16 bytes
_RETRY = (-errno.ECANCELED, -errno.EINTR)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _sys(nr: int, *args: int) -> int:
    """A raw syscall (the GIL is released meanwhile); returns the result or ``-errno``."""
    r = _libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return -ctypes.get_errno() if r < 0 else r


def _addr(v: np.ndarray) -> int:
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(v))   # 3x faster than .ctypes.data
    except (TypeError, ValueError):                             # read-only or empty
        return v.ctypes.data


class _Params(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("sq_entries", "cq_entries", "flags", "cpu", "idle",
                                               "features", "wq_fd", "r0", "r1", "r2")] + \
               [("sq", ctypes.c_uint32 * 10), ("cq", ctypes.c_uint32 * 10)]   # ring offsets


def _setup(entries: int) -> tuple[int, _Params]:
    """``io_uring_setup`` (SUBMIT_ALL where the kernel has it); returns (fd or -errno, params)."""
    for flags in (_SUBMIT_ALL, 0):
        p = _Params(flags=flags)                       # kept alive: the kernel writes into it
        fd = _sys(_SETUP, entries, ctypes.addressof(p))
        if fd != -errno.EINVAL:
            return fd, p
    return fd, p


def unavailable_reason() -> str | None:
    """Why io_uring cannot be used here, or None when a ring can be made."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the io_uring engine supports x86_64 only (ring memory ordering), not {platform.machine()}"
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            if f.read().strip() == "2":
                return "disabled by the kernel (/proc/sys/kernel/io_uring_disabled = 2)"
    except OSError:
        pass
    fd, p = _setup(2)
    if fd < 0:
        return f"io_uring_setup failed: {os.strerror(-fd)} (old kernel, seccomp or io_uring_disabled)"
    os.close(fd)
    return None if p.features & _SINGLE_MMAP else "kernel older than 5.4"
