"""I/O engines: one interface (``base.IOEngine``), one file per implementation."""

from __future__ import annotations

from .base import IOEngine, ReadCommand, aligned_empty


def make_engine(name: str, alignment: int = 4096, threads: int = 4) -> IOEngine:
    """Build the engine named by ``--flatcake-io-engine``.

    ``auto`` picks POSIX (io_uring wins on reads but not on threaded writes here,
    see README).  An engine that cannot run here raises ``ConfigError`` saying why.
    """
    from ..errors import ConfigError

    if name in ("auto", "posix"):
        from .posix import PosixEngine
        return PosixEngine(alignment=alignment, threads=threads)
    if name == "io_uring":
        from .uring import UringEngine
        return UringEngine(alignment=alignment, depth=max(16, 8 * threads))  # ConfigError if unusable
    if name == "kvikio":   # kvikio only feeds device windows; the store's own I/O stays on the host
        from .posix import PosixEngine
        return PosixEngine(alignment=alignment, threads=threads)
    raise ConfigError(f"io_engine={name!r} is not allowed: one of auto, posix, io_uring, kvikio")


__all__ = ["IOEngine", "ReadCommand", "aligned_empty", "make_engine"]
