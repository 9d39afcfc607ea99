"""What the store's calls return, and the counters its ``stats()`` always reports."""

from __future__ import annotations

from dataclasses import dataclass

from .placement import Placement

COUNTERS = ("ssd_blocks_written", "ssd_bytes_written", "memory_blocks_written", "writes_not_stored",
            "read_commands", "bytes_read", "bytes_wanted", "bytes_gap", "memory_blocks_read",
            "ssd_blocks_read", "checksum_failures", "read_errors", "reclaimed_sessions",
            "promoted_blocks")


@dataclass(frozen=True)
class PutResult:
    stored: int                  # new blocks stored by this call
    existing: int                # blocks that were already stored (skipped)
    failed: int                  # new blocks not stored (full disk, capacity, I/O error)
    session: int | None
    placements: tuple[Placement, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class GetResult:
    hits: int                    # leading blocks restored and verified
    from_memory: int
    from_ssd: int
    read_commands: int
    bytes_read: int
    bytes_wanted: int
    corrupt: int                 # blocks dropped because their checksum did not match
