"""The engine contract on io_uring, plus what only io_uring has: registered buffers,
batching, deep queues, per-command errors, close and ring death without hangs."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest
from tests.support.engines import A, EngineContract

from sglang_flatcake.errors import ConfigError, IOEngineError
from sglang_flatcake.io import uring
from sglang_flatcake.io.base import ReadCommand, aligned_empty

WHY = uring.unavailable_reason()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"io_uring unavailable: {WHY}")
T = 20  # seconds: any wait longer than this is a hang


def wait_all(handles):
    """Wait on every handle from another thread, so a hang fails the test instead of
    hanging it; returns the exceptions, None for successes."""
    out = []

    def run():
        for h in handles:
            try:
                h.wait()
                out.append(None)
            except IOEngineError as e:
                out.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(T)
    assert not t.is_alive(), "handles did not finish: hang"
    return out


def filled(eng, path, nbytes, seed=0):
    data = eng.alloc(nbytes)
    data[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    eng.write(path, 0, data)
    return data


class TestUringDirect(EngineContract):
    def make(self):
        return uring.UringEngine(alignment=A, depth=8, max_io_bytes=8 * A, bounce_bytes=2 * A)

    def test_o_direct_is_used_on_a_real_disk(self, eng, path):
        eng.write(path, 0, eng.alloc(A))
        assert eng.is_direct(path)


class TestUringBuffered(EngineContract):
    def make(self):
        return uring.UringEngine(alignment=A, depth=4, direct=False)


class TestUringSpecific:
    @pytest.fixture
    def eng(self):
        e = uring.UringEngine(alignment=A, depth=16)
        yield e
        e.close()

    @pytest.fixture
    def path(self, tmp_path):
        return str(tmp_path / "f.bin")

    def test_stats_have_the_posix_keys(self, eng):
        keys = {"engine", "direct", "buffered_files", "read_commands", "read_ops", "bytes_read",
                "write_ops", "bytes_written", "bounce_ops", "errors"}
        st = eng.stats()
        assert keys <= set(st) and st["engine"] == "io_uring" and st["depth"] == 16

    def test_alloc_buffers_use_fixed_ops(self, eng, path):
        data = filled(eng, path, 16 * A)
        st = eng.stats()
        assert st["registered_buffers"] >= 1 and st["fixed_ops"] >= 1   # WRITE_FIXED
        out = eng.alloc(16 * A)
        eng.read([ReadCommand(path, i * A, A) for i in range(16)],
                 [out[i * A:(i + 1) * A] for i in range(16)])              # slices of one buffer
        assert np.array_equal(out, data)
        assert eng.stats()["fixed_ops"] - st["fixed_ops"] == 16

    def test_unregistered_buffers_use_plain_ops(self, eng, path):
        data = filled(eng, path, 4 * A)
        before = eng.stats()["fixed_ops"]
        out = aligned_empty(4 * A)                                         # not from eng.alloc
        eng.read([ReadCommand(path, 0, 4 * A)], [out])
        assert np.array_equal(out, data) and eng.stats()["fixed_ops"] == before

    def test_registered_slot_freed_when_buffer_dies(self, path):
        e = uring.UringEngine(alignment=A, depth=4, registered_slots=2)
        try:
            for _ in range(10):                     # more allocations than slots, all registered
                b = e.alloc(A)
                assert e._slot_of(b, b.ctypes.data) >= 0
                del b
        finally:
            e.close()

    def test_bounce_buffers_are_registered(self, eng, path):
        filled(eng, path, 4 * A)
        before = eng.stats()
        a = np.empty(A + 7, np.uint8)                                      # unaligned target
        eng.read([ReadCommand(path, 0, A + 7)], [a])
        st = eng.stats()
        assert st["bounce_ops"] > before["bounce_ops"] and st["fixed_ops"] > before["fixed_ops"]

    def test_many_small_reads_in_flight_and_batched(self, eng, path):
        n = 512
        data = filled(eng, path, n * A, seed=3)
        outs = [eng.alloc(A) for _ in range(n)]
        order = np.random.default_rng(4).permutation(n)
        handles = eng.submit([ReadCommand(path, int(i) * A, A) for i in order], outs)
        assert all(e is None for e in wait_all(handles))
        for i, o in zip(order, outs):
            assert np.array_equal(o, data[i * A:(i + 1) * A])
        st = eng.stats()
        assert 1 < st["peak_inflight"] <= 16
        assert st["read_ops"] >= n and st["enter_calls"] < st["read_ops"]  # many SQEs per enter

    def test_large_command_is_split_and_scatter_over_many_pieces(self, path):
        e = uring.UringEngine(alignment=A, depth=4, max_io_bytes=4 * A)
        try:
            data = filled(e, path, 64 * A)
            dest = e.alloc(64 * A)
            pieces = [dest[i * A:(i + 1) * A] for i in range(64)][::-1]
            e.read([ReadCommand(path, 0, 64 * A)], [pieces])
            for i in range(64):
                assert np.array_equal(pieces[i], data[i * A:(i + 1) * A])
            assert e.stats()["read_ops"] == 16
        finally:
            e.close()

    def test_error_completion_fails_only_its_command(self, eng, path, tmp_path):
        data = filled(eng, path, 4 * A)
        bad = str(tmp_path / "wronly.bin")
        with open(bad, "wb") as f:
            f.write(b"x" * (4 * A))
        eng._files.fds[bad] = (os.open(bad, os.O_WRONLY), False)    # reading it completes with -EBADF
        outs = [eng.alloc(A) for _ in range(4)]
        cmds = [ReadCommand(path, 0, A), ReadCommand(bad, 2 * A, A),
                ReadCommand(path, 10 * A, A), ReadCommand(path, 3 * A, A)]
        errs = wait_all(eng.submit(cmds, outs))
        assert errs[0] is None and errs[3] is None
        assert errs[1].errno == errno.EBADF and bad in str(errs[1]) and str(2 * A) in str(errs[1])
        assert "short read" in str(errs[2]) and str(10 * A) in str(errs[2])
        assert np.array_equal(outs[0], data[:A]) and np.array_equal(outs[3], data[3 * A:])
        assert eng.stats()["errors"] == 2

    def test_submit_from_several_threads(self, eng, path):
        n = 256
        data = filled(eng, path, n * A, seed=5)
        bad = []

        def reader(k):
            outs = [eng.alloc(A) for _ in range(n // 8)]
            idx = [(k * 37 + j * 11) % n for j in range(n // 8)]
            eng.read([ReadCommand(path, i * A, A) for i in idx], outs)
            bad.extend(i for i, o in zip(idx, outs) if not np.array_equal(o, data[i * A:(i + 1) * A]))

        ts = [threading.Thread(target=reader, args=(k,)) for k in range(6)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(T)
        assert not any(t.is_alive() for t in ts) and not bad

    def test_handles_outlive_the_submitting_thread(self, eng, path):
        """Requests belong to the ring thread, so a submitter that exits cancels nothing."""
        data = filled(eng, path, 64 * A)
        outs, got = [eng.alloc(A) for _ in range(64)], []
        t = threading.Thread(target=lambda: got.extend(
            eng.submit([ReadCommand(path, i * A, A) for i in range(64)], outs)))
        t.start()
        t.join(T)
        assert all(e is None for e in wait_all(got))
        assert np.array_equal(np.concatenate(outs), data)

    def test_concurrent_writes(self, eng, path):
        eng.allocate(path, 64 * A)
        datas = [eng.alloc(2 * A) for _ in range(32)]
        for i, d in enumerate(datas):
            d[:] = i
        hs = eng.submit_writes([(path, i * 2 * A, d) for i, d in enumerate(datas)])
        assert all(e is None for e in wait_all(hs))
        out = eng.alloc(64 * A)
        eng.read([ReadCommand(path, 0, 64 * A)], [out])
        assert np.array_equal(out, np.repeat(np.arange(32, dtype=np.uint8), 2 * A))

    def test_close_with_pending_work_fails_pending_handles(self, path):
        e = uring.UringEngine(alignment=A, depth=2)
        data = filled(e, path, 256 * A)
        outs = [e.alloc(A) for _ in range(2000)]
        hs = e.submit([ReadCommand(path, (i % 256) * A, A) for i in range(2000)], outs)
        closer = threading.Thread(target=e.close)
        closer.start()
        closer.join(T)
        assert not closer.is_alive(), "close hung"
        errs = wait_all(hs)
        failed = [x for x in errs if x is not None]
        assert failed and all(x.errno == errno.ECANCELED and "closed" in str(x) for x in failed)
        for i, x in enumerate(errs):
            if x is None:
                assert np.array_equal(outs[i], data[(i % 256) * A:(i % 256 + 1) * A])
        with pytest.raises(IOEngineError):
            e.read([ReadCommand(path, 0, A)], [outs[0]])
        e.close()                                            # idempotent

    def test_ring_death_fails_pending_handles(self, eng, path, monkeypatch):
        filled(eng, path, 8 * A)
        monkeypatch.setattr(eng, "_enter", lambda *a: -errno.EBADF)   # the ring stops working
        hs = eng.submit([ReadCommand(path, i * A, A) for i in range(8)], [eng.alloc(A) for _ in range(8)])
        errs = wait_all(hs)
        assert all(x is not None and "ring failed" in str(x) and path in str(x) for x in errs)
        with pytest.raises(IOEngineError):
            eng.submit([ReadCommand(path, 0, A)], [eng.alloc(A)])

    def test_unaligned_pieces_over_many_bounce_buffers(self, path):
        e = uring.UringEngine(alignment=A, depth=4, bounce_slots=1, bounce_bytes=A)
        try:
            raw = np.random.default_rng(6).integers(0, 256, 6 * A + 101, dtype=np.uint8)
            src = np.empty(raw.size + 1, np.uint8)[1:]                     # unaligned source
            src[:] = raw
            e.write(path, 0, src)                                          # 7 bounce writes, 1 slot
            outs = [np.empty(6 * A + 101, np.uint8) for _ in range(4)]
            targets = [[o[:333], o[333:5000], o[5000:]] for o in outs]      # unaligned scatter lists
            e.read([ReadCommand(path, 0, 6 * A + 101)] * 4, targets)
            assert all(np.array_equal(o, raw) for o in outs)
            assert e.stats()["bounce_ops"] >= 7 + 4 * 7 and e.stats()["errors"] == 0
        finally:
            e.close()

    def test_register_an_external_buffer(self, eng, path):
        data = filled(eng, path, 8 * A)
        window = aligned_empty(8 * A)
        assert eng.register(window)
        before = eng.stats()["fixed_ops"]
        eng.read([ReadCommand(path, 0, 8 * A)], [window.reshape(8, A)])     # a 2-D view of it
        assert np.array_equal(window, data) and eng.stats()["fixed_ops"] == before + 1

    def test_non_contiguous_target_refused(self, eng, path):
        filled(eng, path, 2 * A)
        with pytest.raises(ValueError, match="contiguous"):
            eng.read([ReadCommand(path, 0, A)], [np.empty(2 * A, np.uint8)[::2]])


def test_unavailable_io_uring_raises_config_error(monkeypatch):
    monkeypatch.setattr(uring, "unavailable_reason", lambda: "io_uring_setup failed: EPERM")
    with pytest.raises(ConfigError, match="io_uring"):
        uring.UringEngine()
