"""Every threshold of the design, validated once.

``FlatCakeConfig`` is frozen: build it with keyword arguments or with
``FlatCakeConfig.from_mapping`` (strings accepted, as they arrive from
``--flatcake-*`` flags or ``--hicache-storage-backend-extra-config``).  A bad
value raises ``ConfigError`` naming the setting and what is allowed.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, fields
from typing import Any, Mapping

from .errors import ConfigError

IO_ENGINES = ("auto", "posix", "io_uring", "kvikio")
ON_MISMATCH = ("refuse", "reset")

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}


def parse_bytes(value: Any, name: str = "value") -> int:
    """Parse ``4GiB``, ``512MiB``, ``65536`` or an int into bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a byte size such as 4GiB, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"{name}: expected a byte size such as 65536, 64KiB, 4GiB; got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _parse_bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}: expected true or false, got {value!r}")


def check_ip(host: Any, name: str = "host") -> str:
    """``host`` must be a unicast IP address peers can reach (a bind address for transfers);
    ``ConfigError`` naming ``name`` and the value if not."""
    import ipaddress
    try:
        ip = ipaddress.ip_address(str(host))
    except ValueError:
        ip = None
    if ip is None or ip.is_unspecified or ip.is_multicast:
        raise ConfigError(f"{name}={host!r} is not allowed: expected the IP address of the "
                          f"interface other nodes reach (e.g. 127.0.0.1 on one host, or the "
                          f"node's RDMA/TCP address; not 0.0.0.0)")
    return str(host)


def check_directory_url(url: Any, name: str = "cluster_directory") -> str:
    """``""`` (no cluster) or ``redis://HOST:PORT[/DB]``; ``ConfigError`` naming the value."""
    from urllib.parse import urlsplit
    if url == "":
        return url
    try:
        u = urlsplit(str(url))
        db = u.path.strip("/")
        ok = (u.scheme in ("redis", "rediss") and bool(u.hostname) and u.port is not None
              and (db == "" or db.isdigit()))
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"{name}={url!r} is not allowed: expected redis://HOST:PORT or "
                          f"redis://HOST:PORT/DB (empty: no cluster)")
    return str(url)


def default_store_dir() -> str:
    """Where a store lives when no directory is given: the user's cache directory
    (``$XDG_CACHE_HOME`` or ``~/.cache``), not a predictable name others can create first."""
    import os
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sglang-flatcake")


@dataclass(frozen=True)
class FlatCakeConfig:
    """The store's settings; each field's ``help`` metadata is its flag help."""

    short_reply_tokens: int = dataclasses.field(default=512, metadata={
        "help": "a later turn whose previous reply had at most this many tokens goes to memory"})
    agent_context_tokens: int = dataclasses.field(default=32768, metadata={
        "help": "a write whose existing context exceeds this many tokens goes to SSD"})
    shared_refcount: int = dataclasses.field(default=2, metadata={
        "help": "a prefix shared by at least this many live requests goes to memory"})
    memory_bytes: int = dataclasses.field(default=4 << 30, metadata={
        "help": "capacity of the host-memory arena (bytes, or 4GiB)", "bytes": True})
    ssd_bytes: int = dataclasses.field(default=64 << 30, metadata={
        "help": "capacity of the SSD tier (bytes, or 512GiB)", "bytes": True})
    high_watermark: float = dataclasses.field(default=0.90, metadata={
        "help": "usage fraction past which whole sessions are reclaimed"})
    low_watermark: float = dataclasses.field(default=0.80, metadata={
        "help": "reclaim stops once usage is under this fraction"})
    merge_gap_bytes: int = dataclasses.field(default=64 << 10, metadata={
        "help": "read through gaps smaller than this between wanted ranges", "bytes": True})
    alignment: int = dataclasses.field(default=4096, metadata={
        "help": "I/O alignment for offsets, lengths and buffers (a power of two)", "bytes": True})
    window_layers: int = dataclasses.field(default=2, metadata={
        "help": "depth of the device read window, in layers"})
    io_engine: str = dataclasses.field(default="auto", metadata={
        "help": "I/O engine: " + "|".join(IO_ENGINES)})
    io_threads: int = dataclasses.field(default=4, metadata={
        "help": "reads in flight per store"})
    extent_bytes: int = dataclasses.field(default=4 << 20, metadata={
        "help": "unit of SSD space: session files grow by doubling, in whole extents", "bytes": True})
    node_id: int = dataclasses.field(default=0, metadata={
        "help": "this node's number in block addresses (0..4095)"})
    durable: bool = dataclasses.field(default=True, metadata={
        "help": "fdatasync each segment before it is acknowledged"})
    verify_reads: bool = dataclasses.field(default=True, metadata={
        "help": "check every block's checksum on read (a mismatch is a miss)"})
    on_layout_mismatch: str = dataclasses.field(default="refuse", metadata={
        "help": "a store written with another layout: refuse to start, or reset it empty"})
    single_queue: bool = dataclasses.field(default=False, metadata={
        "help": "ablation: one first-come first-served queue instead of FlatCake's ready and "
                "SSD-preparing queues"})
    prefetch_budget_bytes: int = dataclasses.field(default=1 << 30, metadata={
        "help": "KV bytes of SSD prefetch in flight at once; a prefetch that does not fit "
                "waits (never cancelled)", "bytes": True})
    queue_aging: float = dataclasses.field(default=0.5, metadata={
        "help": "SSD-preparing queue: later arrivals may overtake a restore for at most this many "
                "times its own restore time (deadline order); 0: first come first served"})
    recompute_when_faster: bool = dataclasses.field(default=True, metadata={
        "help": "at admission, recompute a request's SSD part instead of restoring it when the "
                "restore (disk backlog included, measured restore rate) would end later than "
                "recomputing those tokens (prefill backlog included, measured prefill rate); "
                "memory hits are kept"})
    ssd_path: str = dataclasses.field(default="", metadata={
        "help": "SSD tier on one raw block device or one pre-sized regular file (created with "
                "ssd_bytes if missing) instead of a directory of session files; default: the "
                "directory"})
    ssd_force: bool = dataclasses.field(default=False, metadata={
        "help": "use ssd_path even though it holds a filesystem, partition table or other data "
                "(it is overwritten); a mounted device is always refused"})
    start_empty: bool = dataclasses.field(default=False, metadata={
        "help": "start with an empty logical cache, keeping the on-disk layout"})
    checkpoint_interval: int = dataclasses.field(default=1024, metadata={
        "help": "region medium: write a metadata checkpoint every this many segments (and at "
                "close); 0: only at close and when the allocation journal is half full"})
    store_dir: str = dataclasses.field(default="", metadata={
        "help": "root of the store (each rank uses its own subfolder); default: "
                "--file-storage-path's folder, else $XDG_CACHE_HOME/sglang-flatcake (~/.cache/"
                "sglang-flatcake): private to the user, never a shared /tmp name"})
    cluster_directory: str = dataclasses.field(default="", metadata={
        "help": "join a cluster through this Redis page directory (redis://HOST:PORT[/DB]): "
                "serve this node's sessions to the others and restore theirs over Mooncake's "
                "Transfer Engine; default: off, a single node"})
    cluster_secret_file: str = dataclasses.field(default="", metadata={
        "help": "file holding the cluster's shared secret (>= 16 bytes, mode 600; required "
                "with --flatcake-cluster-directory): every message, grant and directory "
                "entry between nodes is authenticated with it"})
    cluster_bind: str = dataclasses.field(default="127.0.0.1", metadata={
        "help": "IP address the Transfer Engine and the owner service bind to: the interface "
                "other nodes reach (cluster only)"})
    remote_timeout_s: float = dataclasses.field(default=1.0, metadata={
        "help": "a remote restore not done within this many seconds is a miss (recomputed); "
                "cluster only"})

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ConfigError(
                    f"{name}={getattr(self, name)!r} is not allowed: {allowed}")

        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", int) and (isinstance(v, bool) or not isinstance(v, int)):
                raise ConfigError(f"{f.name}={v!r} is not allowed: expected an integer")
            if f.type in ("bool", bool) and not isinstance(v, bool):
                raise ConfigError(f"{f.name}={v!r} is not allowed: expected True or False "
                                  "(from_mapping parses strings such as 'true' and 'off')")
        need(self.short_reply_tokens >= 0, "short_reply_tokens", "expected >= 0")
        need(self.agent_context_tokens > 0, "agent_context_tokens", "expected > 0")
        need(self.shared_refcount >= 2, "shared_refcount", "expected >= 2 (1 means not shared)")
        need(self.memory_bytes >= 0, "memory_bytes", "expected >= 0 (0 disables the memory tier)")
        need(self.ssd_bytes > 0, "ssd_bytes", "expected > 0")
        need(isinstance(self.high_watermark, (int, float)) and 0 < self.high_watermark <= 1,
             "high_watermark", "expected a fraction in (0, 1]")
        need(isinstance(self.low_watermark, (int, float))
             and 0 <= self.low_watermark < self.high_watermark,
             "low_watermark", f"expected a fraction in [0, high_watermark={self.high_watermark})")
        need(self.alignment >= 512 and self.alignment & (self.alignment - 1) == 0,
             "alignment", "expected a power of two >= 512")
        need(self.merge_gap_bytes >= 0, "merge_gap_bytes", "expected >= 0")
        need(self.window_layers >= 2, "window_layers", "expected >= 2 (a double buffer)")
        need(self.io_engine in IO_ENGINES, "io_engine", "one of " + ", ".join(IO_ENGINES))
        need(1 <= self.io_threads <= 256, "io_threads", "expected 1..256")
        need(self.extent_bytes >= self.alignment and self.extent_bytes % self.alignment == 0,
             "extent_bytes", f"expected a multiple of alignment ({self.alignment})")
        need(self.extent_bytes <= self.ssd_bytes, "extent_bytes",
             f"expected at most ssd_bytes ({self.ssd_bytes}): the SSD tier holds whole extents")
        need(0 <= self.node_id < 4096, "node_id", "expected 0..4095 (12 bits)")
        need(self.prefetch_budget_bytes > 0, "prefetch_budget_bytes", "expected > 0")
        need(isinstance(self.queue_aging, (int, float)) and not isinstance(self.queue_aging, bool)
             and 0 <= self.queue_aging < float("inf"), "queue_aging", "expected a number >= 0")
        need(self.checkpoint_interval >= 0, "checkpoint_interval", "expected >= 0 segments")
        need("\0" not in self.ssd_path, "ssd_path", "expected a path")
        check_directory_url(self.cluster_directory, "cluster_directory")
        check_ip(self.cluster_bind, "cluster_bind")
        need("\0" not in self.cluster_secret_file, "cluster_secret_file", "expected a path")
        need(isinstance(self.remote_timeout_s, (int, float))
             and not isinstance(self.remote_timeout_s, bool)
             and 0 < self.remote_timeout_s <= 60, "remote_timeout_s", "expected 0 < seconds <= 60")
        need(self.on_layout_mismatch in ON_MISMATCH, "on_layout_mismatch",
             "one of " + ", ".join(ON_MISMATCH))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], prefix: str = "") -> "FlatCakeConfig":
        """Build from a mapping of strings or typed values.

        Unknown keys raise ``ConfigError`` listing the known ones; ``prefix`` is
        prepended to names in messages (e.g. ``--flatcake-``).
        """
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for raw_key, value in values.items():
            key = raw_key.replace("-", "_")
            if key.startswith("flatcake_"):
                key = key[len("flatcake_"):]
            if key not in known:
                raise ConfigError(
                    f"unknown setting {raw_key!r}; known: {', '.join(sorted(known))}")
            f = known[key]
            label = prefix + key.replace("_", "-") if prefix else key
            try:
                if f.metadata.get("bytes"):
                    kwargs[key] = parse_bytes(value, label)
                elif f.type in ("bool", bool):
                    kwargs[key] = _parse_bool(value, label)
                elif f.type in ("int", int):
                    kwargs[key] = int(str(value), 0) if isinstance(value, str) else value
                elif f.type in ("float", float):
                    kwargs[key] = float(value)
                else:
                    kwargs[key] = str(value)
            except ConfigError:
                raise
            except (TypeError, ValueError):
                raise ConfigError(f"{label}={value!r} is not allowed: expected {f.type}") from None
        try:
            return cls(**kwargs)
        except ConfigError as e:
            if prefix:
                msg = str(e)
                name = msg.split("=", 1)[0]
                raise ConfigError(prefix + name.replace("_", "-") + "=" + msg.split("=", 1)[1]) from None
            raise

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
