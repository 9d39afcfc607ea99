"""The io_uring engine's registered buffers: one sparse table (Linux 5.19+).

``BufferTable(ring_fd, slots, reserved, lock)`` asks the kernel for a sparse table of
``slots + reserved`` entries; slots ``[0, reserved)`` are the caller's (the bounce
pool, set with ``update``), the others go to ``register``.  ``fixed`` is False when
the kernel refuses the table: every call then answers "not registered" and I/O runs
unregistered.  A slot is given back once the array owning its memory is garbage.
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import numpy as np

from .uring_sys import _BUFFERS2, _BUFFERS_UPDATE, _REGISTER, _sys


class BufferTable:
    def __init__(self, ring_fd: int, slots: int, reserved: int, lock: threading.Lock) -> None:
        self.ring, self.lock = ring_fd, lock
        self.reg: dict[int, tuple] = {}        # id(owning array) -> (weakref, start, end, slot)
        self.dead: list[tuple[int, int]] = []
        arg = (ctypes.c_uint32 * 8)(slots + reserved, 1)   # nr, IORING_RSRC_REGISTER_SPARSE
        self.fixed = _sys(_REGISTER, ring_fd, _BUFFERS2, ctypes.addressof(arg), 32) >= 0
        self.free = list(range(slots + reserved - 1, reserved - 1, -1))

    def __len__(self) -> int:
        return len(self.reg)

    def update(self, slot: int, addr: int, nbytes: int) -> bool:
        """Point ``slot`` at ``[addr, addr+nbytes)`` (0, 0 empties it); False if refused."""
        iov = (ctypes.c_uint64 * 2)(addr, nbytes)
        upd = (ctypes.c_uint64 * 4)(slot, ctypes.addressof(iov), 0, 1)   # offset, data, tags, nr
        return self.fixed and _sys(_REGISTER, self.ring, _BUFFERS_UPDATE,
                                   ctypes.addressof(upd), 32) >= 0

    def register(self, buf: np.ndarray) -> bool:
        """Register ``buf`` (an array owning its memory, or a view of one).  False when the
        table is full, the buffer is over 1 GiB or the kernel refuses (e.g. RLIMIT_MEMLOCK)."""
        base = buf if buf.base is None else buf.base
        if not isinstance(base, np.ndarray) or not 0 < buf.nbytes <= 1 << 30:
            return False
        start = buf.ctypes.data
        with self.lock:
            while self.dead:                       # owners gone since last time
                key, slot = self.dead.pop()
                if self.reg.get(key, (0, 0, 0, -1))[3] == slot:
                    del self.reg[key]
                self.update(slot, 0, 0)
                self.free.append(slot)
            slot = self.free.pop() if self.free else -1
            if slot < 0 or not self.update(slot, start, buf.nbytes):
                self.free += [slot] if slot >= 0 else []
                return False
            self.reg[id(base)] = (weakref.ref(base), start, start + buf.nbytes, slot)
        weakref.finalize(base, self.dead.append, (id(base), slot))
        return True

    def slot_of(self, v: np.ndarray, a: int) -> int:
        """The registered slot holding all of ``v`` (at address ``a``), or -1."""
        base = v if v.base is None else v.base
        got = self.reg.get(id(base))
        return got[3] if got and got[0]() is base and got[1] <= a and a + v.nbytes <= got[2] else -1
