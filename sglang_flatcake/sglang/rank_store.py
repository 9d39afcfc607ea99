"""Where a rank's store lives and how it is opened: one way for both modes.

HiCache mode (``backend.FlatCakeStorage``) and the linker (``linker.FlatCakeLinker``) both
place a rank's store with ``place_rank`` (the root folder, checked writable; the rank's own
folder ``root/<model>/tp<rank>of<size>...``; its share of ``--flatcake-ssd-path``) and open
it with ``open_rank_store``, which checks that the store was written for this model
(``model_identity``).  ``plugin``/``linker_config`` check the root in the launcher.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from ..config import FlatCakeConfig, default_store_dir
from .. import index
from ..errors import ConfigError, UnsafeStoreError
from ..layout import KVLayout
from ..private_fs import private_dir
from ..store import FlatCakeStore
from . import model_identity


def store_root(cfg: FlatCakeConfig, rest: dict) -> str:
    """The folder every rank's store lives under (``--flatcake-store-dir`` or SGLang's file path)."""
    return (cfg.store_dir or os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")
            or rest.get("file_storage_path") or default_store_dir())


def check_writable(root: str) -> None:
    """Create ``root`` (private, ``private_fs.private_dir``) and write a file in it;
    ``ConfigError`` naming the path if that fails or the directory is unsafe."""
    import tempfile
    try:
        safe = private_dir(root)
        with tempfile.NamedTemporaryFile(dir=safe, prefix=".flatcake-write-check-"):
            pass
    except UnsafeStoreError as e:
        raise ConfigError(f"--flatcake-store-dir={root!r} is not safe to use: {e}") from None
    except OSError as e:
        raise ConfigError(f"--flatcake-store-dir={root!r} cannot be written: "
                          f"{e.strerror or e}") from None


def rank_dir(root: str, cfg: Any) -> Path:
    """The folder one rank owns: ``root/<model>/tp<rank>of<size>[_pp..][_dp..][_cp..]``."""
    model = re.sub(r"[^A-Za-z0-9._-]+", "_", str(cfg.model_name or "model"))[-80:]
    parts = [f"tp{cfg.tp_rank}of{cfg.tp_size}"]
    if cfg.pp_size > 1:
        parts.append(f"pp{cfg.pp_rank}of{cfg.pp_size}")
    if cfg.attn_cp_size > 1:
        parts.append(f"cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}")
    if cfg.dp_rank:
        parts.append(f"dp{cfg.dp_rank}")
    return Path(root) / model / "_".join(parts)


def rank_ssd_path(path: str, cfg: Any) -> str:
    """This rank's device or file: ``{rank}`` in ``path`` becomes the global rank number, or
    a comma list gives one path per rank; one plain path serves a single rank only."""
    rank = cfg.pp_rank * cfg.tp_size + cfg.tp_rank
    ranks = cfg.tp_size * cfg.pp_size
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    parts = [p.strip() for p in path.split(",")]
    if len(parts) > 1:
        if len(parts) != ranks:
            raise ConfigError(f"--flatcake-ssd-path lists {len(parts)} paths for {ranks} ranks; "
                              f"give one per rank, or one path with {{rank}}")
        return parts[rank]
    if ranks > 1:
        raise ConfigError(f"--flatcake-ssd-path={path!r} is one region for {ranks} ranks; "
                          f"give one per rank (a comma list) or a path with {{rank}}")
    return path


def place_rank(cfg: FlatCakeConfig, rest: dict, where: Any) -> tuple[Path, FlatCakeConfig]:
    """The folder rank ``where`` owns (under ``store_root``, created and checked writable:
    ``ConfigError`` naming it otherwise) and ``cfg`` with this rank's ``ssd_path``.
    ``where`` has SGLang's ``HiCacheStorageConfig`` rank fields and ``model_name``."""
    root = store_root(cfg, rest)
    check_writable(root)
    if cfg.ssd_path:
        cfg = dataclasses.replace(cfg, ssd_path=rank_ssd_path(cfg.ssd_path, where))
    return rank_dir(root, where), cfg


def open_rank_store(folder: Path, layout: KVLayout, cfg: FlatCakeConfig,
                    model: str | None = None, revision: str | None = None) -> FlatCakeStore:
    """Open (or create) the store of one rank placed by ``place_rank``, for ``model`` (a
    local folder or a name) at ``revision``: a store recorded for another model identity
    (``model_identity``) is refused (``LayoutMismatchError``, one line) or emptied, as
    ``cfg.on_layout_mismatch`` says; the identity is recorded for the next start."""
    ident = model_identity.identity(model, layout, revision)
    fresh = model_identity.check(folder, ident, cfg.on_layout_mismatch)
    index.warm_up()                  # no kernel compiles inside a request's lookup or write
    store = FlatCakeStore(folder, layout, cfg)
    if fresh:
        store.clear()
    model_identity.record(folder, ident)
    return store
