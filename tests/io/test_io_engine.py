"""The POSIX engine against the I/O engine contract (``tests/support/engines.py``), once with
O_DIRECT and once buffered."""

from __future__ import annotations

from sglang_flatcake.io.posix import PosixEngine
from tests.support.engines import A, EngineContract


class TestPosixDirect(EngineContract):
    def make(self):
        return PosixEngine(alignment=A, threads=4, max_io_bytes=8 * A)

    def test_o_direct_is_used_on_a_real_disk(self, eng, path):
        eng.write(path, 0, eng.alloc(A))
        assert eng.is_direct(path)


class TestPosixBuffered(EngineContract):
    def make(self):
        return PosixEngine(alignment=A, threads=2, direct=False)
