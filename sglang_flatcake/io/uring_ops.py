"""The io_uring engine's units of work: ``_Op`` (one SQE) and ``UringHandle`` (one
submitted command, made of ops).  Ops finish only in the thread driving the ring."""

from __future__ import annotations

class _Op:
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
    ``IOEngineError`` naming the file and offset.  Ops finish only in the driving thread."""

    def __init__(self, engine, nbytes: int, write: bool) -> None:   # engine: UringEngine
        self._engine, self._left, self._nbytes, self._write = engine, 0, nbytes, write
        self._err, self._finished, self._ev = None, False, None   # _ev: made by a sleeping waiter

    def _op_done(self, err) -> None:
        self._err = self._err or err
        self._left -= 1
        if self._left == 0:
            if self._err or self._write:
                self._engine._count(*(("errors", 1) if self._err else ("bytes_written", self._nbytes)))
            self._finished = True                      # then read _ev: a sleeper sets it first
            if self._ev is not None:
                self._ev.set()

    def done(self) -> bool:
        return self._finished

    def wait(self) -> None:
        if not self._finished:
            self._engine._wait_for(self)
        if self._err is not None:
            raise self._err
