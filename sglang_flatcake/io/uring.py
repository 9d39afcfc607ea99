"""io_uring engine: batched O_DIRECT I/O through one ring, raw syscalls via ctypes.

- ``submit``/``submit_writes`` queue every op and start up to ``depth`` of them in one
  ``io_uring_enter``.  Whoever waits drives the ring (leader/followers): one waiting
  thread at a time refills the SQ, submits and waits in one ``io_uring_enter`` and
  finishes every command whose CQEs came in; the others sleep until their command is
  done or the driver leaves.  No thread of our own (no GIL ping-pong); thread-safe.
- Nothing is lost: at most ``depth`` ops in flight, the CQ holds twice the SQ.  Every op
  ends in exactly one of: its CQE; ``close`` (ops not started fail with ECANCELED, started
  ones finish first, so the kernel has let go of every buffer); the ring failing (all
  pending ops fail).  An error CQE fails only its command, naming file and offset; short
  transfers resume, a read past EOF fails as "short read"; ops the kernel cancelled
  (ECANCELED/EINTR: work of a submitting thread that exited) are retried.
- Zero copy: aligned targets are read in place, with READ_FIXED/WRITE_FIXED inside a
  registered buffer (``alloc``'s are), READ/WRITE/READV otherwise; unaligned pieces use
  zero-padded bounce buffers from a registered pool.  EINVAL on an O_DIRECT open: the
  file is used buffered.  The shared rings rely on x86-64 store ordering.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import mmap
import os
import threading
from typing import Sequence

import numpy as np

from ..errors import ConfigError, IOEngineError
from ..layout import align_down, align_up
from .base import (O_DIRECT, FileTable, IOEngine, ReadCommand, aligned_empty, check_commands,
                   command_views, datasync, fallocate_to)
from .uring_buffers import BufferTable
from .uring_ops import UringHandle, UringOp
from .uring_sys import (_CQE, _ENTER, _GETEVENTS, _READ, _READ_FIXED, _READV, _RETRY, _SQE,
                        _WRITE, _WRITE_FIXED, _WRITEV, IOV_MAX, _addr, _setup, _sys,
                        unavailable_reason)

class UringEngine(IOEngine):
    name = "io_uring"

    def __init__(self, alignment: int = 4096, depth: int = 64, max_io_bytes: int = 4 << 20,
                 direct: bool = True, registered_slots: int = 1024, bounce_slots: int = 16,
                 bounce_bytes: int = 256 << 10) -> None:
        """``depth`` ops in flight at most.  Raises ``ConfigError`` saying why when io_uring
        cannot run here."""
        super().__init__(alignment)
        why = unavailable_reason()
        if why:
            raise ConfigError(f"io_engine='io_uring' is not available: {why}")
        self.depth = max(1, depth)
        self.max_io_bytes = max(alignment, align_down(max_io_bytes, alignment))
        self.bounce_bytes = max(alignment, align_down(bounce_bytes, alignment))
        self.want_direct = direct and O_DIRECT != 0
        self._lock = threading.Lock()                  # queues, tables, stats
        self._ring_lock = threading.Lock()             # held by the one thread driving the ring
        self._files = FileTable(self.want_direct, self._lock, self._refuse_if_closed)
        self._stats = dict.fromkeys(("read_commands", "read_ops", "bytes_read", "write_ops", "bytes_written",
                                     "bounce_ops", "errors", "fixed_ops", "enter_calls", "peak_inflight"), 0)
        fd, p = _setup(1 << (self.depth - 1).bit_length())
        if fd < 0:
            raise ConfigError(f"io_engine='io_uring' is not available: io_uring_setup: {os.strerror(-fd)}")
        self._ring, sq, cq = fd, list(p.sq), list(p.cq)   # head, tail, mask, entries, .., cqes/.., array
        rw = mmap.PROT_READ | mmap.PROT_WRITE
        size = max(sq[6] + p.sq_entries * 4, cq[5] + p.cq_entries * 16)
        self._rm = mmap.mmap(fd, size, mmap.MAP_SHARED, rw)
        self._sm = mmap.mmap(fd, p.sq_entries * 64, mmap.MAP_SHARED, rw, offset=0x10000000)
        self._u32 = u32 = memoryview(self._rm).cast("I")
        u32[sq[6] // 4:sq[6] // 4 + p.sq_entries] = memoryview(np.arange(p.sq_entries, dtype=np.uint32))
        self._sq_tail_i, self._sq_mask, self._sq_tail = sq[1] // 4, u32[sq[2] // 4], u32[sq[1] // 4]
        self._cq_head_i, self._cq_tail_i, self._cq_mask = cq[0] // 4, cq[1] // 4, u32[cq[2] // 4]
        self._cqes, self._cq_head = cq[5], u32[cq[0] // 4]
        self._backlog: collections.deque[UringOp] = collections.deque()
        self._ops: dict[int, UringOp] = {}                 # user_data -> op in flight
        self._waiters: collections.deque[UringHandle] = collections.deque()   # sleeping followers
        self._next_ud, self._unsub, self._stopping, self._dead = 1, 0, False, None
        # registered buffers: slots [0, bounce_slots) hold the bounce pool
        self._buffers = BufferTable(fd, registered_slots, bounce_slots, self._lock)
        self._bpool = aligned_empty(bounce_slots * self.bounce_bytes, alignment)
        self._bfree = [s for s in range(bounce_slots) if self._buffers.update(
            s, self._bpool.ctypes.data + s * self.bounce_bytes, self.bounce_bytes)]

    # -- files and buffers ------------------------------------------------------
    def _fd(self, path: str, create: bool = False) -> tuple[int, bool]:
        """(fd, direct) for ``path``, opened once: O_DIRECT, or buffered where that is EINVAL."""
        return self._files.get(path, create)

    def _refuse_if_closed(self, path: str) -> None:
        if self._stopping:
            raise IOEngineError(errno.ECANCELED, f"open {path}: the io_uring engine is closed")

    def is_direct(self, path: str) -> bool:
        return self._fd(path)[1]

    def forget(self, path: str) -> None:
        """Close ``path``'s descriptor; its commands must have finished (as with posix)."""
        self._files.forget(path)

    def register(self, buf: np.ndarray) -> bool:
        """Register ``buf`` so I/O inside it uses READ_FIXED/WRITE_FIXED (see
        ``uring_buffers.BufferTable.register``); False once the engine is closing."""
        return not self._stopping and self._buffers.register(buf)

    def _slot_of(self, v: np.ndarray, a: int) -> int:
        return self._buffers.slot_of(v, a)

    def alloc(self, nbytes: int) -> np.ndarray:
        """An aligned buffer, registered with the ring when possible (see ``register``)."""
        buf = aligned_empty(nbytes, self.alignment)
        self.register(buf)
        return buf

    # -- planning (the callers' threads) ---------------------------------------------
    def _plan(self, write, path, fd, direct, off, iov: list[np.ndarray], h: UringHandle) -> list[UringOp]:
        """Ops for one chunk: zero-copy when aligned, else the aligned body in place and the
        rest through zero-padded bounce buffers (as posix does)."""
        a, addrs, n = self.alignment, [_addr(v) for v in iov], sum(v.nbytes for v in iov)
        if not direct or all(p % a == 0 and v.nbytes % a == 0 for p, v in zip(addrs, iov)):
            slot = self._slot_of(iov[0], addrs[0]) if len(iov) == 1 else -1
            return [UringOp(write, fd, direct, path, off, iov, addrs, n, h, buf=slot)]
        ops = []
        if len(iov) == 1 and addrs[0] % a == 0 and n >= a:
            body = align_down(n, a)
            ops.append(UringOp(write, fd, direct, path, off, [iov[0][:body]], addrs, body, h,
                           buf=self._slot_of(iov[0], addrs[0])))
            iov, off, n = [iov[0][body:]], off + body, n - body
        for start in range(0, n, self.bounce_bytes):   # bounce ops of at most one pool slot
            piece, pos, parts = min(self.bounce_bytes, n - start), 0, []
            for v in iov:                              # the caller's bytes in [start, start+piece)
                lo, hi = max(start - pos, 0), min(start + piece - pos, v.nbytes)
                parts += [v[lo:hi]] if lo < hi else []
                pos += v.nbytes
            with self._lock:
                bslot = self._bfree.pop() if self._bfree else -1
            bounce = aligned_empty(align_up(piece, a), a) if bslot < 0 else \
                self._bpool[bslot * self.bounce_bytes:bslot * self.bounce_bytes + align_up(piece, a)]
            if write:
                np.concatenate(parts, out=bounce[:piece])
                bounce[piece:] = 0
            ops.append(UringOp(write, fd, direct, path, off + start, [bounce], [_addr(bounce)],
                           bounce.nbytes if write else piece, h, bslot, bounce, bslot, parts))
        return ops

    def _chunks(self, views: list[np.ndarray]) -> list[list[np.ndarray]]:
        """Iovec lists of at most ``max_io_bytes`` and ``IOV_MAX`` entries."""
        if len(views) == 1 and views[0].nbytes <= self.max_io_bytes:
            return [views]
        out, size = [[]], 0
        for v in views:
            while v.nbytes:
                if size >= self.max_io_bytes or len(out[-1]) >= IOV_MAX:
                    out, size = out + [[]], 0
                out[-1].append(v[:self.max_io_bytes - size])
                size, v = size + out[-1][-1].nbytes, v[out[-1][-1].nbytes:]
        return [c for c in out if c]

    @staticmethod
    def _flat(v) -> np.ndarray:
        if not v.flags.c_contiguous:
            raise ValueError("io_uring: buffers must be contiguous")
        return v if v.ndim == 1 and v.dtype == np.uint8 else v.reshape(-1).view(np.uint8)

    def _start(self, write: bool, items) -> list[UringHandle]:
        """Plan ``(path, (fd, direct), offset, views)`` items, queue them, start what fits."""
        handles, ops, a = [], [], self.alignment
        for path, (fd, direct), off, views in items:
            if len(views) == 1 and views[0].nbytes <= self.max_io_bytes:   # fast path: one aligned op
                v = views[0]
                h, p = UringHandle(self._count, self._wait_for, v.nbytes, write), _addr(v)
                if not direct or (p % a == 0 and v.nbytes % a == 0):
                    ops.append(UringOp(write, fd, direct, path, off, views, [p], v.nbytes, h,
                                   self._slot_of(v, p)))
                    h.expect(1)
                    handles.append(h)
                    continue
            h, mine = UringHandle(self._count, self._wait_for, sum(v.nbytes for v in views),
                                  write), []
            for iov in self._chunks(views):
                mine += self._plan(write, path, fd, direct, off, iov, h)
                off += sum(v.nbytes for v in iov)
            h.expect(len(mine))
            handles.append(h)
            ops += mine
        self._enqueue(ops)
        return handles

    def submit(self, commands: Sequence[ReadCommand], targets: Sequence) -> list[UringHandle]:
        """Queue every command and start up to ``depth`` ops now; one handle per command,
        in order.  ``targets[i]`` is one array or a scatter list of arrays."""
        check_commands(commands, targets, self.alignment)
        items = []
        for cmd, target in zip(commands, targets):
            views = command_views(cmd, target, self._flat)
            items.append((cmd.path, self._fd(cmd.path), cmd.offset, views))
        self._count("read_commands", len(commands))
        self._count("bytes_read", sum(c.length for c in commands))
        return self._start(False, items)

    def submit_writes(self, items: Sequence[tuple[str, int, np.ndarray]]) -> list[UringHandle]:
        """io_uring only: start ``write(path, offset, data)`` for every item as one batch;
        one handle per item.  Each ``data`` belongs to the engine until its ``wait``."""
        for path, offset, _ in items:
            if offset % self.alignment:
                raise ValueError(f"write: offset {offset} of {path} is not {self.alignment}-aligned")
        return self._start(True, [(p, self._fd(p, create=True), o, [self._flat(d)]) for p, o, d in items])

    def write(self, path: str, offset: int, data: np.ndarray) -> None:
        self.submit_writes([(path, offset, data)])[0].wait()

    def allocate(self, path: str, size: int) -> None:
        fallocate_to(self._fd(path, create=True)[0], path, size)

    def sync(self, path: str) -> None:
        datasync(self._fd(path)[0], path)

    # -- driving the ring (only the thread holding _ring_lock) ----------------------------
    def _enqueue(self, ops: list[UringOp]) -> None:
        with self._lock:
            err = self._dead or (IOEngineError(errno.ECANCELED, "the io_uring engine is closed")
                                 if self._stopping else None)
            if err is None:
                self._backlog.extend(ops)
            else:
                self._bfree += [op.bslot for op in ops if op.bslot >= 0]
        if err is not None:
            raise err
        while self._backlog and len(self._ops) < self.depth and self._ring_lock.acquire(blocking=False):
            try:                                       # start what fits now, without waiting
                self._step(0)
            finally:
                self._leave()

    def _leave(self) -> None:
        """Give up the ring and wake one follower whose command is not done to take it."""
        self._ring_lock.release()
        with self._lock:
            while self._waiters:
                w = self._waiters.popleft()
                if not w.done():
                    return w.wake()

    def _wait_for(self, h: UringHandle) -> None:
        """Drive the ring until ``h`` is done, or sleep while another thread drives it
        (woken when ``h`` finishes or when the driver leaves)."""
        while not h.done():
            if self._ring_lock.acquire(blocking=False):
                try:
                    while not h.done():
                        self._step(1)
                finally:
                    self._leave()
                return
            h.arm()
            with self._lock:
                self._waiters.append(h)
            if not h.done() and self._ring_lock.locked():   # else: done, or the driver just left
                h.sleep()

    def _step(self, wait: int) -> None:
        """Fill the SQ, submit, block for a CQE if ``wait``, reap.  A ring error fails every
        pending op and the engine."""
        try:
            with self._lock:
                dropped = self._fill()
            for op in dropped:
                self._finish(op, IOEngineError(errno.ECANCELED, f"{op.verb} {op.path} at {op.off}: "
                                               "the io_uring engine closed before the command ran"))
            if wait and not self._ops:
                return
            r = self._enter(self._unsub, wait, _GETEVENTS if wait else 0)
            self._stats["enter_calls"] += 1
            if r < 0 and r not in (-errno.EINTR, -errno.EAGAIN, -errno.EBUSY):
                raise IOEngineError(-r, f"io_uring_enter: {os.strerror(-r)}")
            self._unsub -= max(r, 0)
            self._reap()
        except Exception as e:
            err = e if isinstance(e, IOEngineError) else IOEngineError(errno.EIO, f"io_uring: {e!r}")
            with self._lock:
                self._dead, ops = err, list(self._ops.values()) + list(self._backlog)
                self._ops.clear()
                self._backlog.clear()
            for op in ops:
                self._finish(op, IOEngineError(err.errno, f"{op.verb} {op.path} at {op.off}: "
                                               f"io_uring ring failed ({err})"))

    def _enter(self, to_submit: int, min_complete: int, flags: int) -> int:
        return _sys(_ENTER, self._ring, to_submit, min_complete, flags, 0, 0)

    def _fill(self) -> list[UringOp]:
        """Move queued ops into the SQ (under _lock).  When closing, empty the queue instead
        and return its ops, to fail."""
        if self._stopping:
            dropped, self._backlog = list(self._backlog), collections.deque()
            return dropped
        n0, st = self._sq_tail, self._stats
        while self._backlog and len(self._ops) < self.depth:
            op, ud = self._backlog.popleft(), self._next_ud
            self._next_ud, self._ops[ud] = ud + 1, op
            if len(op.iov) == 1:
                code = ((_WRITE_FIXED if op.write else _READ_FIXED) if op.buf >= 0 else
                        (_WRITE if op.write else _READ))
                addr, length = op.iov[0][0] + op.done, op.n - op.done
            else:
                skip, vec = op.done, []
                for a, ln in op.iov:
                    vec += [a + skip, ln - skip] if skip < ln else []
                    skip = max(0, skip - ln)
                op.vec = (ctypes.c_uint64 * len(vec))(*vec)   # struct iovec[], alive until the CQE
                code, addr, length = _WRITEV if op.write else _READV, ctypes.addressof(op.vec), len(vec) // 2
            _SQE.pack_into(self._sm, (self._sq_tail & self._sq_mask) * 64, code, 0, 0, op.fd,
                           op.off + op.done, addr, length, 0, ud, max(op.buf, 0), 0, 0, 0, 0)
            self._sq_tail = (self._sq_tail + 1) & 0xFFFFFFFF
            st["write_ops" if op.write else "read_ops"] += 1
            st["fixed_ops"] += op.buf >= 0
            st["bounce_ops"] += op.bounce is not None and op.done == 0
        if self._sq_tail != n0:
            self._u32[self._sq_tail_i] = self._sq_tail      # x86: the SQE stores are visible first
            self._unsub += (self._sq_tail - n0) & 0xFFFFFFFF
            st["peak_inflight"] = max(st["peak_inflight"], len(self._ops))
        return []

    def _reap(self) -> None:
        head, tail, cqes = self._cq_head, self._u32[self._cq_tail_i], []
        while head != tail:
            cqes.append(_CQE.unpack_from(self._rm, self._cqes + (head & self._cq_mask) * 16))
            head = (head + 1) & 0xFFFFFFFF
        self._cq_head = self._u32[self._cq_head_i] = head   # x86: the CQE loads are done first
        with self._lock:
            ops = [(self._ops.pop(ud), res) for ud, res, _ in cqes]
        for op, res in ops:
            self._complete(op, res)

    def _complete(self, op: UringOp, res: int) -> None:
        """One CQE: finish the op, or queue it again for the rest (short or cancelled)."""
        done = op.done + max(res, 0)
        if res in _RETRY and op.retries < 100 and not self._stopping:
            op.retries += 1
        elif res < 0:
            return self._finish(op, IOEngineError(-res, f"{op.verb} {op.path} at {op.off + op.done}: "
                                                  f"{os.strerror(-res)}"))
        elif done < op.need and (res == 0 or (op.direct and done % self.alignment)):
            why = "" if op.write else " (file too small)"
            return self._finish(op, IOEngineError(errno.EIO, f"short {op.verb} of {op.path} at {op.off}: "
                                                  f"{done} of {op.need} bytes{why}"))
        op.done = done
        if done < op.need:
            with self._lock:
                return self._backlog.appendleft(op)
        if op.parts and not op.write:                  # bounce read: copy out
            pos = 0
            for v in op.parts:
                v[...], pos = op.bounce[pos:pos + v.nbytes], pos + v.nbytes
        self._finish(op, None)

    def _finish(self, op: UringOp, err) -> None:
        if op.bslot >= 0:
            with self._lock:
                self._bfree.append(op.bslot)
            op.bslot = -1
        op.handle.op_done(err)

    # -- the rest --------------------------------------------------------------------
    def _count(self, name: str, k: int = 1) -> None:
        with self._lock:
            self._stats[name] += k

    def stats(self) -> dict:
        """posix's keys (``threads`` is 0: no threads of its own; ``depth`` is the ops in
        flight) plus ``fixed_ops``, ``registered_buffers``, ``enter_calls``, ``peak_inflight``."""
        with self._lock:
            return {"engine": self.name, "threads": 0, "depth": self.depth, "direct": self.want_direct,
                    "buffered_files": len(self._files.buffered), "registered_buffers": len(self._buffers),
                    **self._stats}

    def close(self) -> None:
        """Fail the commands not yet started (ECANCELED), let started ones finish, then
        release the ring and every descriptor.  Idempotent."""
        with self._lock:
            stopped, self._stopping = self._stopping, True
        if stopped:
            return
        with self._ring_lock:
            while self._ops or self._backlog:
                self._step(1)
        self._u32.release()
        self._rm.close()
        self._sm.close()
        for fd in [self._ring] + self._files.take_all():
            os.close(fd)
