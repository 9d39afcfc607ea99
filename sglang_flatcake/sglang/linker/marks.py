"""The linker's stages on the per-request timeline (``sglang.timeline``); called only when
``timeline.ON``, so they cost nothing when it is off."""

from __future__ import annotations

from typing import Any

from .. import timeline


def looked_up(linker: Any, rid: str, found: Any, ahead: list) -> None:
    """``lookup`` returned ``found`` (``lookup.Found``) behind the loads ``ahead``."""
    timeline.mark(rid, "lookup", pages=found.pages, tail_pages=found.tail,
                  ssd_pages=found.ssd_pages, cut=found.cut)
    if found.choice is not None:
        timeline.decision(rid, found.choice, linker.finder.decider, "lookup",
                          found.choice.restore, restores_ahead=sum(1 for ld in ahead
                                                                   if ld.ssd_bytes),
                          disk_backlog_bytes=sum(ld.ssd_bytes for ld in ahead))


def started(loads: list) -> None:
    """A load batch starts (``start_layer_wise_loading``)."""
    for ld in loads:
        timeline.mark(ld.rid, "restore_start", pages=len(ld.keys), ssd_bytes=ld.ssd_bytes,
                      batch=len(loads))


def finished(loads: list, landed: bool) -> None:
    """A load batch was waited for (``finish_layer_wise_loading``)."""
    for ld in loads:
        timeline.mark(ld.rid, "restore_end", landed=bool(landed))
