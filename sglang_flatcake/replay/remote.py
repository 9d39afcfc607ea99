"""The cost of a remote restore in virtual time, from the measured loopback run."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .sizes import GIB

# benchmarks/results/remote_restore.json (a 256 MiB session restored from another process
# over Mooncake's Transfer Engine on TCP loopback; tests/replay/test_replay_cluster.py keeps these
# equal to that file): the median restore and its first grant (the per-request round trip)
MEASURED_SESSION_BYTES = 268435456
MEASURED_REMOTE_S = 0.6190729620002458
MEASURED_GRANT_S = 0.012999648000004527
MEASURED_FROM = "benchmarks/results/remote_restore.json"


@dataclass(frozen=True)
class RemoteModel:
    """Time of one remote restore: ``rtt_s`` once per request plus bytes at ``gib_s``."""

    gib_s: float = MEASURED_SESSION_BYTES / GIB / (MEASURED_REMOTE_S - MEASURED_GRANT_S)
    rtt_s: float = MEASURED_GRANT_S

    def __post_init__(self) -> None:
        if not self.gib_s > 0:
            raise ConfigError(f"--remote-gib-s: remote bandwidth must be > 0, got {self.gib_s!r}")
        if not self.rtt_s >= 0:
            raise ConfigError(f"--remote-rtt-ms: remote round trip must be >= 0, got "
                              f"{self.rtt_s * 1e3!r} ms")

    def seconds(self, full_bytes: float) -> float:
        return self.rtt_s + full_bytes / (self.gib_s * GIB)
