"""The store's media: host memory (``memory.HostArena``) and the SSD tier
(``base.SSDTier``: ``ssd.SessionFiles`` or ``region.RegionFiles``)."""

from __future__ import annotations


def open_tier(config, layout, engine, root, read_only: bool):
    """The SSD tier ``config`` asks for: session files under ``root``, or, with
    ``config.ssd_path``, one region (which checks the layout recorded on its medium)."""
    if not config.ssd_path:
        from .ssd import SessionFiles
        return SessionFiles(root, engine, config.extent_bytes, config.ssd_bytes,
                            read_only=read_only)
    from .region import RegionFiles
    return RegionFiles(config, layout, engine, read_only)
