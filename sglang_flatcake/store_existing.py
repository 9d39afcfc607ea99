"""The store at a path as its manifest records it, for a reader that opens it (``flatcake
inspect``): a directory's ``flatcake.json`` or a region's superblock.  Called through
``store_open.existing`` by ``FlatCakeStore.open_existing``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .config import FlatCakeConfig
from .layout import KVLayout
from .recovery import STORE_MANIFEST, read_json


def existing(root, config: FlatCakeConfig | None):
    """``(root, layout, config, scratch)`` to open the store at ``root`` with the layout
    its manifest records: a directory's ``flatcake.json``, or a region's superblock (then
    ``root`` is a new scratch directory, ``scratch`` True)."""
    base = config or FlatCakeConfig()
    scratch = False
    if Path(root).exists() and not Path(root).is_dir():
        from .tiers.region_meta import read_region_manifest
        m, region_bytes = read_region_manifest(root)
        base = FlatCakeConfig(**{**base.to_dict(), "ssd_path": str(root),
                                 "ssd_bytes": region_bytes})
        root, scratch = tempfile.mkdtemp(prefix="flatcake-inspect-"), True
    else:
        m = read_json(Path(root) / STORE_MANIFEST)
    if base.alignment != m.get("alignment"):
        base = FlatCakeConfig(**{**base.to_dict(), "alignment": m["alignment"]})
    return root, KVLayout.from_dict(m["layout"]), base, scratch
