"""The io_uring engine's units of work: ``UringOp`` (one SQE) and ``UringHandle`` (one
submitted command, made of ops).  Ops finish only in the thread driving the ring."""

from __future__ import annotations

import threading
from typing import Callable

class UringOp:
    """One SQE's worth of work: ``n`` bytes at ``off`` over ``iov`` (address, length)
    pairs, ``need`` of which must arrive; re-queued for the rest after a short transfer."""
    __slots__ = ("write", "verb", "fd", "direct", "path", "off", "iov", "keep", "n", "need", "done",
                 "buf", "bounce", "bslot", "parts", "handle", "vec", "retries")

    def __init__(self, write, fd, direct, path, off, arrays, addrs, need, handle, buf=-1,
                 bounce=None, bslot=-1, parts=None):
        self.write, self.verb, self.fd, self.direct = write, ("write" if write else "read"), fd, direct
        self.path, self.off, self.keep, self.need, self.handle = path, off, arrays, need, handle
        self.iov = [(a, v.nbytes) for a, v in zip(addrs, arrays)]
        self.n = self.iov[0][1] if len(arrays) == 1 else sum(x[1] for x in self.iov)
        self.done, self.buf, self.retries, self.vec = 0, buf, 0, None
        self.bounce, self.bslot, self.parts = bounce, bslot, parts


class UringHandle:
    """One submitted command; ``wait`` returns when all its ops are done or raises
    ``IOEngineError`` naming the file and offset.  Ops finish only in the driving thread.

    The engine gives it ``count(name, k)`` (its stats) and ``drive(handle)`` (run the ring
    until the handle is done, or sleep while another thread runs it), sets how many ops
    it waits for (``expect``), reports each finished op (``op_done``) and, for a sleeping
    waiter, arms and wakes its event (``arm``/``wake``, ``sleep``)."""

    def __init__(self, count: Callable[[str, int], None], drive: Callable[["UringHandle"], None],
                 nbytes: int, write: bool) -> None:
        self._count, self._drive, self._nbytes, self._write = count, drive, nbytes, write
        self._left, self._err, self._finished = 0, None, False
        self._ev: threading.Event | None = None   # made by a sleeping waiter

    def expect(self, ops: int) -> None:
        """The command is ``ops`` ops (none: it is done already)."""
        self._left, self._finished = ops, ops == 0

    def op_done(self, err) -> None:
        """One op ended (``err``: its ``IOEngineError`` or None); the last wakes a sleeper."""
        self._err = self._err or err
        self._left -= 1
        if self._left == 0:
            if self._err or self._write:
                self._count(*(("errors", 1) if self._err else ("bytes_written", self._nbytes)))
            self._finished = True                      # then read _ev: a sleeper sets it first
            if self._ev is not None:
                self._ev.set()

    def done(self) -> bool:
        return self._finished

    def arm(self) -> None:
        """Before a waiter sleeps: a cleared event that ``op_done`` or ``wake`` sets."""
        self._ev = self._ev or threading.Event()
        self._ev.clear()

    def sleep(self) -> None:
        self._ev.wait()

    def wake(self) -> None:
        self._ev.set()

    def wait(self) -> None:
        if not self._finished:
            self._drive(self)
        if self._err is not None:
            raise self._err
