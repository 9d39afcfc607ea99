"""What a rank's store caches KV for: the model's identity, checked each time the store opens.

A rank's folder is named after the model (``rank_store.rank_dir``), so new weights at the same
path would otherwise be served the old weights' KV.  ``identity`` describes the model: its
``config.json`` (hashed), the KV layout (which holds the dtype), and either the revision the
user names (SGLang's ``--revision``) or a fingerprint of the weight files (names, sizes and
their first and last 64 KiB: a safetensors header names every tensor, its dtype and offsets).
``IDENTITY_FILE`` in the rank's folder records it; ``check`` compares, and on a mismatch
either refuses (``LayoutMismatchError``, one line naming what differs) or says, in one log
line, that the store starts fresh, as ``on_layout_mismatch`` (refuse | reset) says.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from ..errors import LayoutMismatchError
from ..layout import KVLayout

log = logging.getLogger("sglang_flatcake")
IDENTITY_FILE = "model.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
EDGE_BYTES = 64 << 10


def weights_fingerprint(folder: Path) -> str:
    """sha256 over the weight files of ``folder``: names, sizes, first and last 64 KiB."""
    h = hashlib.sha256()
    for f in sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()):
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(EDGE_BYTES))
            fh.seek(max(0, size - EDGE_BYTES))
            h.update(fh.read(EDGE_BYTES))
    return h.hexdigest()


def identity(model: str | None, layout: KVLayout, revision: str | None = None) -> dict[str, Any]:
    """The identity of ``model`` (a local folder, or a name SGLang resolves) served with
    ``layout``: a local folder contributes its config and weights (the weights only when no
    ``revision`` is named); a name, the name."""
    out: dict[str, Any] = {"layout": layout.to_dict(), "revision": revision or ""}
    folder = Path(model) if model else None
    if folder is not None and folder.is_dir():
        cfg = folder / "config.json"
        out["config"] = hashlib.sha256(cfg.read_bytes()).hexdigest() if cfg.is_file() else ""
        out["weights"] = "" if revision else weights_fingerprint(folder)
    else:
        out["model"] = str(model or "")
    return out


def check(folder: Path, want: dict[str, Any], on_mismatch: str) -> bool:
    """Compare ``want`` with the identity recorded in ``folder``.  True when the store must
    start fresh (``on_mismatch`` reset; logged in one line); ``LayoutMismatchError`` naming
    what differs when it is refused; False when it matches or nothing is recorded yet."""
    path = Path(folder) / IDENTITY_FILE
    if not path.is_file():
        return False
    try:
        have = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        have = {"unreadable": str(e)}
    if have == want:
        return False
    differ = ", ".join(k for k in sorted(set(have) | set(want)) if have.get(k) != want.get(k))
    if on_mismatch == "reset":
        log.warning("flatcake: store %s was written for another model (%s differ): "
                    "starting it fresh", folder, differ)
        return True
    raise LayoutMismatchError(f"store {folder} was written for another model ({differ} "
                              f"differ); refusing to serve its KV. Point the store at another "
                              f"directory, or start it with on_layout_mismatch=reset "
                              f"(--flatcake-on-layout-mismatch reset) to empty it")


def record(folder: Path, ident: dict[str, Any]) -> None:
    """Write ``ident`` to ``folder`` (a temporary name, then renamed)."""
    path = Path(folder) / IDENTITY_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(ident, sort_keys=True))
    os.replace(tmp, path)
