"""I/O engines: one interface (``base.IOEngine``), one file per implementation."""

from __future__ import annotations

from .base import IOEngine, ReadCommand, aligned_empty


def make_engine(name: str, alignment: int = 4096, threads: int = 4) -> IOEngine:
    """Build the engine named by ``--flatcake-io-engine``.

    ``auto`` picks POSIX on a CPU machine.  An engine that cannot run here
    raises ``ConfigError`` saying why.
    """
    from ..errors import ConfigError

    if name in ("auto", "posix"):
        from .posix import PosixEngine
        return PosixEngine(alignment=alignment, threads=threads)
    if name in ("io_uring", "kvikio"):
        raise ConfigError(f"io_engine={name!r} is not available in this build; use posix or auto")
    raise ConfigError(f"io_engine={name!r} is not allowed: one of auto, posix, io_uring, kvikio")


__all__ = ["IOEngine", "ReadCommand", "aligned_empty", "make_engine"]
