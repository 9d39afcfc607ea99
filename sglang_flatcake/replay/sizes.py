"""Sizes and cost models: model presets, the GPU and disk models, and ``--scale``.

Every time in a replay is *full-size* virtual time: what the run would take
with the model's real bytes per token, on the modelled GPU and disk.  The bytes
that really move on this machine are the full-size bytes times ``scale``, so a
large trace fits this disk; budgets shrink by the same factor, so every ratio
(memory / working set, staging / restore size) is the full-size one.

Scaling keeps real blocks a multiple of 4 KiB (O_DIRECT) and shrinks the
layer count before the bytes per layer (a real block-layer stays >= 4 KiB), so
the CPU cost of a restore stays bounded; costs are computed back at full size
(bytes / scale, and a layer-split read counts ``layers / real layers`` commands).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError
from ..layout import KVLayout

GIB = 1 << 30


@dataclass(frozen=True)
class ModelPreset:
    name: str
    kind: str                 # "mha" or "mla"
    layers: int
    kv_bytes_per_token: int   # per GPU worker (per TP rank for MHA)
    gpu: str                  # default GpuPreset
    note: str


MODELS = {
    "llama-3.1-8b": ModelPreset("llama-3.1-8b", "mha", 32, 32 * 2 * 8 * 128 * 2, "h100",
                                "32 layers x K,V x 8 KV heads x 128 x bf16, TP 1"),
    "llama-3.1-70b-tp8": ModelPreset("llama-3.1-70b-tp8", "mha", 80, 80 * 2 * 1 * 128 * 2,
                                     "h100x8", "80 layers x K,V x (8 KV heads / TP 8) x 128 x bf16"),
    "deepseek-v3": ModelPreset("deepseek-v3", "mla", 61, 61 * 576 * 2, "b200x8",
                               "MLA: 61 layers x 576 latent x bf16, replicated per rank"),
    "deepseek-v4-flash": ModelPreset("deepseek-v4-flash", "mla", 43, 3922, "b200x8",
                                     "43 layers, compressed attention; 3,922 B/token is the paper's "
                                     "0.8 GiB per 219K tokens per GPU"),
}


@dataclass(frozen=True)
class GpuPreset:
    name: str
    prefill_tps: float        # prefill tokens per second of one serving instance (assumed)
    h2d_gib_s: float          # host-to-device copy bandwidth
    note: str


GPUS = {
    "h100": GpuPreset("h100", 15_000, 50.0, "Llama-3.1-8B on 1x H100, long-context prefill "
                      "(assumed: ~16 GFLOP/token at ~40% of dense BF16, less for attention)"),
    "h100x8": GpuPreset("h100x8", 15_000, 50.0, "Llama-3.1-70B TP8 on 8x H100 (assumed)"),
    "b200x8": GpuPreset("b200x8", 60_000, 55.0, "DeepSeek-class MoE on 8x B200, the paper's "
                        "main setup (assumed; use --prefill-tps to change)"),
}


@dataclass(frozen=True)
class DiskModel:
    """Exclusive service time of I/O: ``bytes / bandwidth + commands * per-command cost``;
    concurrent jobs share it (``clock.SharedDisk``)."""

    name: str
    read_gib_s: float
    write_gib_s: float
    cmd_us: float
    note: str

    def read_s(self, nbytes: float, commands: float) -> float:
        return nbytes / (self.read_gib_s * GIB) + commands * self.cmd_us * 1e-6

    def write_s(self, nbytes: float, commands: float) -> float:
        return nbytes / (self.write_gib_s * GIB) + commands * self.cmd_us * 1e-6


DISKS = {
    "local": DiskModel("local", 1.2, 1.0, 14.0,
                       "this machine's disk (notes/machines.md: 0.9-1.8 GiB/s sequential O_DIRECT, "
                       "4 KiB random 0.23 GiB/s at depth 32)"),
    "nvme-gen5": DiskModel("nvme-gen5", 5.0, 4.0, 2.0,
                           "a datacenter NVMe drive per worker, ~5 GB/s as in the paper"),
}


@dataclass(frozen=True)
class Sizing:
    """Full-size and real (scaled) block geometry of one replay."""

    model: ModelPreset
    kv_bytes_per_token: int   # full size
    block_tokens: int
    layout: KVLayout          # real layout of the flatcake store
    scale: float              # real bytes / full-size bytes (effective)

    @property
    def block_bytes(self) -> int:
        """Real bytes of one block."""
        return self.layout.block_bytes

    @property
    def full_block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_tokens

    @property
    def layer_factor(self) -> float:
        """Full-size layers per real layer (commands of layer-split reads scale by this)."""
        return self.model.layers / self.layout.layers

    def full(self, real_bytes: float) -> float:
        return real_bytes / self.scale

    def real(self, full_bytes: float) -> int:
        """Real bytes of a full-size budget, rounded down to whole blocks."""
        return int(full_bytes * self.scale) // self.block_bytes * self.block_bytes


def make_sizing(model: ModelPreset, block_tokens: int, kv_bytes_per_token: int | None = None,
                scale: float | None = None, target_block_bytes: int = 8192,
                min_layer_bytes: int = 4096) -> Sizing:
    """Pick the real block size (``scale`` given, or ``target_block_bytes`` when None)."""
    kv = kv_bytes_per_token or model.kv_bytes_per_token
    if kv <= 0 or block_tokens <= 0:
        raise ConfigError(f"kv bytes per token ({kv}) and block tokens ({block_tokens}) must be > 0")
    full = kv * block_tokens
    if scale is None:
        real = target_block_bytes
    else:
        if not 0 < scale <= 1:
            raise ConfigError(f"--scale {scale} is not allowed: expected a fraction in (0, 1]")
        real = max(4096, math.ceil(full * scale / 4096) * 4096)
    parts = 2 if model.kind == "mha" else 1
    layers = 1
    while (layers * 2 <= model.layers and real // (layers * 2) >= min_layer_bytes
           and real % (layers * 2 * parts) == 0):
        layers *= 2
    layout = KVLayout(model.kind, layers, parts, real // (layers * parts), block_tokens, "uint8")
    return Sizing(model, kv, block_tokens, layout, layout.block_bytes / full)


def resolve_model(name: str | None, kv_bytes_per_token: int | None) -> ModelPreset:
    if name is None:
        name = "deepseek-v4-flash"
    if name not in MODELS:
        raise ConfigError(f"--model {name!r}: expected one of {', '.join(MODELS)}")
    return MODELS[name]
