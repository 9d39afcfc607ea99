"""What a write continues, from the store's lineage of its parent key (both modes).

Write-through alternates prompt and reply, so the turn is the lineage's ``writes // 2`` and the
previous reply its last odd-numbered write.  HiCache mode's parent is the last prefix key SGLang
hands the backend, linker mode's the page before the node in its request row (``linker.signals``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Continues:
    """The write's ``turn``, its previous reply's tokens, and the tokens of the chain up to and
    including the parent (``position_tokens``, the context where the caller knows no better)."""

    turn: int = 0
    prev_reply_tokens: int = 0
    position_tokens: int = 0


def continues(store, parent_key: Optional[str]) -> Continues:
    """What a write after ``parent_key`` (None: it starts a chain) continues in ``store``."""
    lin = store.lineage(parent_key) if parent_key is not None else None
    if lin is None:
        return Continues()
    ps = store.layout.page_tokens
    return Continues(lin.writes // 2, lin.last_reply_blocks * ps, lin.position * ps)
