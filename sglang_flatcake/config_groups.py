"""The settings of each consumer, one frozen dataclass each.

``PlacementConfig`` (where a block goes), ``MediaConfig`` (the memory arena, the SSD tier and
the store on disk), ``IOConfig`` (how blocks are read), ``SchedConfig`` (the two queues and
admission) and ``ClusterConfig`` (other nodes).  ``config.FlatCakeConfig`` composes them into
the one flat config the ``--flatcake-*`` flags fill; ``cfg.placement``, ``cfg.media``,
``cfg.io``, ``cfg.sched`` and ``cfg.cluster`` give each consumer its own part.

Adding a setting is one edit: a ``setting(...)`` field in its group (a name no other group
uses).  The flag, the extra-config key, the replay flag and the docs row follow from it.
A rule between two fields of one group goes in that group's ``check``; a rule between groups
in ``FlatCakeConfig.check_across``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .address import MAX_NODE, MAX_OFFSET
from .config_check import check_directory_url, check_fields, check_ip, refuse, setting

IO_ENGINES = ("auto", "posix", "io_uring", "kvikio")
ON_MISMATCH = ("refuse", "reset")
ADDRESSABLE = MAX_OFFSET + 1                 # bytes a 48-bit block offset reaches (256 TiB)
MAX_MERGE_GAP = 64 << 20
MAX_ALIGNMENT = 1 << 20
MAX_WINDOW_LAYERS = 256


def _no_nul(v: str) -> bool:
    return "\0" not in v


@dataclass(frozen=True)
class PlacementConfig:
    """Where a block lives, decided once when it is written (``placement.place``)."""

    short_reply_tokens: int = setting(
        512, "a later turn whose previous reply had at most this many tokens goes to memory",
        allowed=">= 0", ok=lambda v: v >= 0)
    agent_context_tokens: int = setting(
        32768, "a write whose existing context exceeds this many tokens goes to SSD",
        allowed="> 0", ok=lambda v: v > 0)
    shared_refcount: int = setting(
        2, "a prefix shared by at least this many live requests goes to memory",
        allowed=">= 2 (1 means not shared)", ok=lambda v: v >= 2)

    def __post_init__(self) -> None:
        PlacementConfig.check(self)

    def check(self) -> None:
        check_fields(self, PlacementConfig)


@dataclass(frozen=True)
class MediaConfig:
    """The host-memory arena, the SSD tier and the store on disk (``store.py``, ``tiers/``,
    ``reclaimer.py``).  ``memory_bytes`` is also checked against this machine's memory, and
    ``extent_bytes`` against ``alignment``, by ``FlatCakeConfig``."""

    memory_bytes: int = setting(
        4 << 30, "capacity of the host-memory arena, allocated at start (pinned when CUDA is "
                 "present); 0 disables the memory tier", size=True,
        allowed="0..256TiB and at most this machine's memory",
        ok=lambda v: 0 <= v <= ADDRESSABLE)
    ssd_bytes: int = setting(
        64 << 30, "capacity of the SSD tier", size=True,
        allowed="1..256TiB (a 48-bit block offset)", ok=lambda v: 0 < v <= ADDRESSABLE)
    high_watermark: float = setting(
        0.90, "usage fraction past which whole sessions are reclaimed, least recently used "
              "first", allowed="a fraction in (0, 1]", ok=lambda v: 0 < v <= 1)
    low_watermark: float = setting(
        0.80, "reclaim stops once usage is under this fraction",
        allowed="a fraction in [0, high_watermark)", ok=lambda v: 0 <= v < 1)
    extent_bytes: int = setting(
        4 << 20, "unit of SSD space: session files grow by doubling (at most 256MiB a step), "
                 "in whole extents", size=True,
        allowed="a multiple of alignment, at most ssd_bytes", ok=lambda v: v > 0)
    durable: bool = setting(True, "fdatasync each segment before it is acknowledged")
    on_layout_mismatch: str = setting(
        "refuse", "a store written with another layout: refuse to start, or reset it empty",
        allowed="one of " + ", ".join(ON_MISMATCH), ok=lambda v: v in ON_MISMATCH)
    ssd_path: str = setting(
        "", "SSD tier on one raw block device or one pre-sized regular file (created with "
            "ssd_bytes if missing) instead of a directory of session files; with TP/PP > 1 a "
            "path with {rank} or a comma list, one per rank; default: the directory",
        allowed="a path", ok=_no_nul)
    ssd_force: bool = setting(
        False, "use ssd_path even though it holds a filesystem, partition table or other data "
               "(it is overwritten); a mounted device is always refused")
    start_empty: bool = setting(
        False, "start with an empty logical cache, keeping the on-disk layout")
    checkpoint_interval: int = setting(
        1024, "region medium: write a metadata checkpoint every this many segments (and at "
              "close); 0: only at close and when the allocation journal is half full",
        allowed=">= 0 segments", ok=lambda v: v >= 0)
    store_dir: str = setting(
        "", "root of the store (each rank uses its own subfolder); default: "
            "--file-storage-path's folder, else $XDG_CACHE_HOME/sglang-flatcake (~/.cache/"
            "sglang-flatcake): private to the user, never a shared /tmp name",
        allowed="a path", ok=_no_nul)

    def __post_init__(self) -> None:
        MediaConfig.check(self)

    def check(self) -> None:
        """The fields, then: low under high, an extent no larger than the tier."""
        check_fields(self, MediaConfig)
        if not self.low_watermark < self.high_watermark:
            raise refuse("low_watermark", self.low_watermark,
                         f"a fraction in [0, high_watermark={self.high_watermark})")
        if self.extent_bytes > self.ssd_bytes:
            raise refuse("extent_bytes", self.extent_bytes,
                          f"at most ssd_bytes ({self.ssd_bytes}): the SSD tier holds whole "
                          "extents")


@dataclass(frozen=True)
class IOConfig:
    """How blocks are read: the I/O engine, read planning and the device window
    (``io/``, ``read/``)."""

    alignment: int = setting(
        4096, "I/O alignment for offsets, lengths and buffers (O_DIRECT)", size=True,
        allowed="a power of two in 512..1MiB",
        ok=lambda v: 512 <= v <= MAX_ALIGNMENT and v & (v - 1) == 0)
    merge_gap_bytes: int = setting(
        64 << 10, "read through gaps smaller than this between wanted ranges (each store keeps "
                  "a buffer this large to read gaps into)", size=True,
        allowed="0..64MiB", ok=lambda v: 0 <= v <= MAX_MERGE_GAP)
    window_layers: int = setting(
        2, "depth of the device read window, in layers (one buffer each)",
        allowed=f"2..{MAX_WINDOW_LAYERS} (2: a double buffer)",
        ok=lambda v: 2 <= v <= MAX_WINDOW_LAYERS)
    io_engine: str = setting(
        "auto", "I/O engine: auto (POSIX), posix, io_uring, or kvikio (device window only)",
        allowed="one of " + ", ".join(IO_ENGINES), ok=lambda v: v in IO_ENGINES)
    io_threads: int = setting(
        4, "reads in flight per store", allowed="1..256", ok=lambda v: 1 <= v <= 256)
    verify_reads: bool = setting(
        True, "check every block's checksum on read (a mismatch is a miss)")

    def __post_init__(self) -> None:
        IOConfig.check(self)

    def check(self) -> None:
        check_fields(self, IOConfig)


@dataclass(frozen=True)
class SchedConfig:
    """The scheduler: the ready and SSD-preparing queues, the prefetch budget, and restore or
    recompute at admission (``sched/``, ``sglang/hicache/scheduling.py``)."""

    single_queue: bool = setting(
        False, "ablation: one first-come first-served queue instead of FlatCake's ready and "
               "SSD-preparing queues")
    prefetch_budget_bytes: int = setting(
        1 << 30, "KV bytes of SSD prefetch in flight at once; a prefetch that does not fit "
                 "waits (never cancelled)", size=True, allowed="> 0", ok=lambda v: v > 0)
    queue_aging: float = setting(
        0.5, "SSD-preparing queue: later arrivals may overtake a restore for at most this many "
             "times its own restore time (deadline order); 0: first come first served",
        allowed="a number >= 0", ok=lambda v: 0 <= v < float("inf"))
    publish_wait_ms: float = setting(
        20.0, "HiCache mode: after starting restores, the scheduler waits up to this long for "
              "them to end, so a quick restore is admitted in the step it started, batched with "
              "the requests that came with it, instead of one step later; 0: never waits",
        allowed="0..1000", ok=lambda v: 0 <= v <= 1000)
    recompute_when_faster: bool = setting(
        True, "at admission, recompute a request's SSD part instead of restoring it when the "
              "restore (disk backlog included, measured restore rate) would end later than "
              "recomputing those tokens (prefill backlog included, measured prefill rate; its own "
              "tokens at the measured margin: what a step adds per new token); "
              "memory hits are kept")
    late_drop: bool = setting(
        False, "HiCache mode: drop a picked restore still waiting for device slots past the time "
               "recomputing it would take, and prefill its request instead (measured 2026-12-07: "
               "the dropped requests then waited 2-9 s more for admission, pass 2 1.5-6.2x no "
               "cache's mean against 0.39x without it; off by default)")
    writer_nice: int = setting(
        19, "CPU priority (nice) of the threads that write KV to the store (the linker's "
            "offload worker, SGLang's HiCache storage-backup thread), so that on a busy CPU "
            "the writes take what the forward leaves; 0: the forward's priority",
        allowed="0..19", ok=lambda v: 0 <= v <= 19)
    writer_quiet: bool = setting(
        True, "the threads that write KV to the store (the linker's offload worker, SGLang's "
              "HiCache storage-backup thread) write while SGLang's scheduler runs no forward "
              "(they share the forward's GIL: a write beside a prefill made its forward 10-43 ms "
              "longer on a 2-core CPU server, whatever their nice); once the scheduler has been busy "
              "2 s without such a moment they write at once, so a server that never idles still "
              "stores at its full rate; false: as soon as the pages are ready")
    offload_backlog_bytes: int = setting(
        1 << 30, "linker mode: a node offloaded while this many KV bytes of device pages "
                 "already wait to be written is not stored (its device pages, locked until "
                 "then, unlock at once), so a slow or stalled disk never holds device memory",
        size=True, allowed="> 0", ok=lambda v: v > 0)
    timeline: str = setting(
        "", "append each request's timeline (arrival, lookup, restore-or-recompute decision "
            "and its inputs, restore, publish, first forward, first token) to this file as "
            "JSON lines, with or without a flatcake mode (benchmarks/timeline_diff.py reads "
            "it); the flag only; default: off, no per-request work",
        allowed="a path", ok=_no_nul)

    def __post_init__(self) -> None:
        SchedConfig.check(self)

    def check(self) -> None:
        check_fields(self, SchedConfig)


@dataclass(frozen=True)
class ClusterConfig:
    """This node among others: its number in block addresses and, with a directory, the
    Transfer Engine and the owner service (``cluster/``)."""

    node_id: int = setting(
        0, "this node's number in block addresses",
        allowed=f"0..{MAX_NODE} (12 bits)", ok=lambda v: 0 <= v <= MAX_NODE)
    cluster_directory: str = setting(
        "", "join a cluster through this Redis page directory: serve this node's sessions to "
            "the others and restore theirs over Mooncake's Transfer Engine; default: off, a "
            "single node", allowed="redis://HOST:PORT[/DB], or empty",
        check=check_directory_url)
    cluster_secret_file: str = setting(
        "", "file holding the cluster's shared secret (>= 16 bytes, mode 600; required with "
            "--flatcake-cluster-directory): every message, grant and directory entry between "
            "nodes is authenticated with it", allowed="a path, or empty",
        ok=lambda v: "\0" not in v)
    cluster_node_key_file: str = setting(
        "", "file holding this node's own key (mode 600; required with "
            "--flatcake-cluster-directory; made by `python -m sglang_flatcake.cluster.keygen`): "
            "what signs its directory entries and requests and opens its grants",
        allowed="a path, or empty", ok=lambda v: "\0" not in v)
    cluster_roster_file: str = setting(
        "", "the operator's list of every node's public keys (`<node id> <ed25519> <x25519>` "
            "per line; writable by its owner only; required with --flatcake-cluster-directory): "
            "a node not in it, or signing as another, is not believed",
        allowed="a path, or empty", ok=lambda v: "\0" not in v)
    cluster_bind: str = setting(
        "127.0.0.1", "IP address the owner service binds to and the Transfer Engine announces: "
                     "the interface other nodes reach (cluster only; Mooncake 0.3.13's engine "
                     "listens on every interface, so firewall its ports)",
        allowed="a unicast IP address (not 0.0.0.0)", check=check_ip)
    remote_timeout_s: float = setting(
        1.0, "a remote restore not done within this many seconds is a miss (recomputed); "
             "cluster only", allowed="0 < seconds <= 60", ok=lambda v: 0 < v <= 60)

    def __post_init__(self) -> None:
        ClusterConfig.check(self)

    def check(self) -> None:
        check_fields(self, ClusterConfig)


GROUPS = {"placement": PlacementConfig, "media": MediaConfig, "io": IOConfig,
          "sched": SchedConfig, "cluster": ClusterConfig}
