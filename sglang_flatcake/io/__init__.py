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


def make_window_engine(name: str, device: str, alignment: int = 4096,
                       threads: int = 4) -> tuple[IOEngine, str]:
    """(engine, window device) for the device read path: kvikio straight into device memory
    when it can run, else a host engine and a host window (the caller then stages)."""
    from ..errors import ConfigError

    if device == "cuda" and name in ("auto", "kvikio"):
        from .kvikio_engine import KvikioEngine, kvikio_usable
        ok, why = kvikio_usable()
        if ok:
            return KvikioEngine(alignment=alignment, threads=threads), "cuda"
        if name == "kvikio":
            raise ConfigError(f"io_engine='kvikio' cannot run here: {why}")
    elif name == "kvikio":
        raise ConfigError("io_engine='kvikio' reads into device memory; the device is cpu")
    return make_engine("posix" if name in ("auto", "kvikio") else name, alignment, threads), "cpu"


__all__ = ["IOEngine", "ReadCommand", "aligned_empty", "make_engine", "make_window_engine"]
