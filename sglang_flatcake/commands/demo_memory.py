"""Host memory each ``flatcake demo`` backend used: SGLang's HiCache host pool plus the
backend's own.

- SGLang's host pool (HiCache modes only; ``none`` and the linker modes have none): the
  tokens of SGLang's own log line ``Allocating kv hierarchical KV host pool: N tokens, X GB
  host memory.`` times the KV bytes per token (layers x 2 x KV heads x head dim x the KV
  dtype of ``KV Cache is allocated. dtype: ...``, from the model's ``config.json``); when the
  config cannot be read, the GB SGLang logged.  SGLang allocates the whole pool at start.
- flatcake (both modes): the arena bytes its memory tier holds (``flatcake_bytes_memory``
  from ``/metrics``) and the arena's capacity (``flatcake_memory_capacity``; committed
  up front only where the arena is pinned, ``flatcake_memory_pinned``).
- mooncake: the global segment the client mounts (allocated at setup).
- file: nothing beyond the OS page cache.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

POOL_LINE = re.compile(r"Allocating \S+ hierarchical KV host pool: (\d+) tokens, ([\d.]+) GB")
KV_DTYPE = re.compile(r"KV Cache is allocated\. dtype: torch\.(\w+)")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "uint8": 1}


def kv_bytes_per_token(model_dir: str, dtype: str) -> int | None:
    """KV bytes per token of an MHA model at ``model_dir`` (one rank); None if unknown."""
    cfg_path = Path(model_dir) / "config.json"
    if dtype not in DTYPE_BYTES or not cfg_path.is_file():
        return None
    cfg = json.loads(cfg_path.read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * heads * head_dim * DTYPE_BYTES[dtype]


def host_pool(log_text: str, model_dir: str) -> dict:
    """``{"tokens", "bytes"}`` of SGLang's HiCache host pool, from its server log (zeros when
    the server allocated none)."""
    m = POOL_LINE.search(log_text)
    if m is None:
        return {"tokens": 0, "bytes": 0}
    tokens = int(m.group(1))
    d = KV_DTYPE.search(log_text)
    per = kv_bytes_per_token(model_dir, d.group(1)) if d else None
    return {"tokens": tokens, "bytes": tokens * per if per else int(float(m.group(2)) * 1e9)}


def backend_host_bytes(backend: str, metrics: dict, mooncake_segment: int) -> dict:
    """The backend's own host memory: ``used`` and ``reserved`` bytes (see the module doc)."""
    if backend.startswith("flatcake"):
        cap = int(metrics.get("flatcake_memory_capacity", 0))
        return {"used": int(metrics.get("flatcake_bytes_memory", 0)),
                "reserved": cap if metrics.get("flatcake_memory_pinned") else 0,
                "capacity": cap}
    if backend == "mooncake":
        return {"used": mooncake_segment, "reserved": mooncake_segment, "capacity": mooncake_segment}
    return {"used": 0, "reserved": 0, "capacity": 0}


def memory_fields(backend: str, log_text: str, model_dir: str, metrics: dict,
                  mooncake_segment: int) -> dict:
    """The row's host-memory fields: SGLang's host pool, the backend's, and their sum."""
    pool = host_pool(log_text, model_dir)
    own = backend_host_bytes(backend, metrics, mooncake_segment)
    return {"host_pool_tokens": pool["tokens"], "host_pool_bytes": pool["bytes"],
            "backend_host_bytes": own["used"], "backend_host_capacity_bytes": own["capacity"],
            "backend_host_reserved_bytes": own["reserved"],
            "host_memory_bytes": pool["bytes"] + own["used"]}
