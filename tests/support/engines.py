"""The contract every I/O engine meets (``sglang_flatcake.io.base.IOEngine``): a test
module subclasses ``EngineContract`` once per engine and supplies ``make()``."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from sglang_flatcake.errors import IOEngineError
from sglang_flatcake.io.base import ReadCommand, aligned_empty

A = 4096


class EngineContract:
    def make(self):
        raise NotImplementedError

    @pytest.fixture
    def eng(self):
        e = self.make()
        yield e
        e.close()

    @pytest.fixture
    def path(self, tmp_path):
        return str(tmp_path / "f.bin")

    def test_alloc_is_aligned(self, eng):
        for n in (1, A, 3 * A + 5):
            b = eng.alloc(n)
            assert b.ctypes.data % eng.alignment == 0 and b.nbytes == n

    def test_aligned_round_trip(self, eng, path):
        data = eng.alloc(4 * A)
        data[:] = np.random.default_rng(0).integers(0, 256, data.size, dtype=np.uint8)
        eng.allocate(path, 8 * A)
        eng.write(path, A, data)
        eng.sync(path)
        out = eng.alloc(4 * A)
        eng.read([ReadCommand(path, A, 4 * A)], [out])
        assert np.array_equal(out, data)

    def test_unaligned_tail_uses_bounce_buffer(self, eng, path):
        data = eng.alloc(A + 100)
        data[:] = 9
        eng.write(path, 0, data)
        out = eng.alloc(A + 100)
        eng.read([ReadCommand(path, 0, A + 100)], [out])
        assert np.array_equal(out, data)
        if eng.stats()["direct"]:
            assert eng.stats()["bounce_ops"] >= 1

    def test_many_commands_in_flight_and_chunked(self, eng, path):
        n = 64
        data = eng.alloc(n * A)
        data[:] = np.random.default_rng(1).integers(0, 256, data.size, dtype=np.uint8)
        eng.write(path, 0, data)
        outs = [eng.alloc(A) for _ in range(n)]
        cmds = [ReadCommand(path, i * A, A) for i in range(n)][::-1]
        eng.read(cmds, outs)
        for c, o in zip(cmds, outs):
            assert np.array_equal(o, data[c.offset:c.offset + A])

    def test_scatter_list_reads_in_place(self, eng, path):
        data = eng.alloc(6 * A)
        data[:] = np.repeat(np.arange(6, dtype=np.uint8), A)
        eng.write(path, 0, data)
        dest = aligned_empty(6 * A)
        dest[:] = 255
        # scatter blocks 0..5 of the file into reversed slots of dest
        targets = [dest[(5 - i) * A:(6 - i) * A] for i in range(6)]
        eng.read([ReadCommand(path, 0, 6 * A)], [targets])
        for i in range(6):
            assert (dest[(5 - i) * A:(6 - i) * A] == i).all()

    def test_unaligned_scatter_pieces_still_correct(self, eng, path):
        data = eng.alloc(2 * A)
        data[:] = np.arange(2 * A, dtype=np.uint64).astype(np.uint8)
        eng.write(path, 0, data)
        a, b = np.empty(1000, np.uint8), np.empty(2 * A - 1000, np.uint8)
        eng.read([ReadCommand(path, 0, 2 * A)], [[a, b]])
        assert np.array_equal(np.concatenate([a, b]), data)

    def test_short_read_fails_instead_of_hanging(self, eng, path):
        eng.write(path, 0, eng.alloc(A))
        with pytest.raises(IOEngineError, match="short read"):
            eng.read([ReadCommand(path, 0, 4 * A)], [eng.alloc(4 * A)])
        assert eng.stats()["errors"] >= 1

    def test_missing_file_is_an_error(self, eng, tmp_path):
        with pytest.raises(IOEngineError):
            eng.read([ReadCommand(str(tmp_path / "nope"), 0, A)], [eng.alloc(A)])

    def test_unaligned_offset_refused(self, eng, path):
        eng.write(path, 0, eng.alloc(2 * A))
        with pytest.raises(ValueError, match="aligned"):
            eng.read([ReadCommand(path, 100, A)], [eng.alloc(A)])

    def test_enospc_on_allocate(self, eng, path, monkeypatch):
        def full(fd, off, n):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(os, "posix_fallocate", full)
        with pytest.raises(IOEngineError) as e:
            eng.allocate(path, 1 << 20)
        assert e.value.errno == errno.ENOSPC

    def test_buffered_fallback_where_o_direct_is_refused(self, eng, path, monkeypatch):
        """tmpfs on older kernels answers O_DIRECT with EINVAL: the file is opened buffered."""
        real_open = os.open

        def no_direct(p, flags, *a):
            if flags & getattr(os, "O_DIRECT", 0):
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_open(p, flags, *a)
        monkeypatch.setattr(os, "open", no_direct)
        data = eng.alloc(A + 10)
        data[:] = 3
        eng.write(path, 0, data)
        out = eng.alloc(A + 10)
        eng.read([ReadCommand(path, 0, A + 10)], [out])
        assert (out == 3).all()
        if eng.stats()["direct"]:
            assert eng.stats()["buffered_files"] == 1
            assert not eng.is_direct(path)
