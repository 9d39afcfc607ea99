"""Write-time signals in linker mode, from what the linker sees (no scheduler hooks).

An offload carries a node's page keys and device slots, and SGLang's ``session_id`` of
the insert (None for plain ``/generate`` calls).  Placement (``placement.place``) needs
the turn, the existing context and the previous reply's length; they come from:

- **context**: where the node starts in the request that inserts it.  The request's row
  of ``req_to_token`` (``params.req_to_token_pool``, handed to every linker) holds the
  node's slots at tokens ``[p, p + len)``; ``p`` is the context.  Only the rows a request
  holds now are searched (``live_rows``: every row but the pool's ``free_slots``): the
  table has a row per possible running request (2,049 x 16,384 on the demo's CPU server),
  and scanning all of it cost 5 ms per node on the scheduler thread, between the forward
  and the request's first token.  A node found at no page-aligned place of a live row (or
  at two different places) has no context signal.
- **parent key**: the page before the node in that row, ``row[p - page]``, is a slot the
  linker offloaded or loaded earlier (every ancestor of a tree node was computed and
  offloaded, write-through, or loaded by the linker), so ``SlotKeys`` names its key.  With
  ``session_id`` and no parent found, the session's last written key is the parent.
- **turn, previous reply**: the store's lineage of the parent key (``sglang.lineage``, as
  in HiCache mode); no parent: turn 0 (the first-turn rule: SSD) and no previous reply.
- **shared prefix**: the linker sees no request counts: refcount 1 (the shared-prefix
  rule does not fire in this mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ...placement import WriteSignals
from ..lineage import continues


class SlotKeys:
    """The key whose KV a device page holds, as last offloaded or loaded (first slot of
    the page -> key).  Owned by the linker; a stale entry only mis-signals placement."""

    def __init__(self) -> None:
        self._keys: dict[int, str] = {}

    def note(self, slots, keys, page: int) -> None:
        firsts = torch.as_tensor(slots).reshape(-1)[::page].tolist()
        for s, k in zip(firsts, keys):
            self._keys[int(s)] = k

    def get(self, slot: int) -> Optional[str]:
        return self._keys.get(int(slot))

    def clear(self) -> None:
        self._keys.clear()


@dataclass(frozen=True)
class Where:
    """A node's place: ``context`` tokens before it (None: unknown), the parent page's
    first slot (None: the node starts its chain, or unknown)."""

    context: Optional[int]
    parent_slot: Optional[int]


def live_rows(req_to_token_pool) -> list[int]:
    """The rows of SGLang's ``ReqToTokenPool`` not in its ``free_slots`` (held by a request
    now, and the padding row 0)."""
    free = np.asarray(req_to_token_pool.free_slots, dtype=np.int64)
    live = np.ones(req_to_token_pool.req_to_token.shape[0], dtype=bool)
    live[free] = False
    return np.flatnonzero(live).tolist()


def find_in_rows(req_to_token: torch.Tensor, slots: torch.Tensor, page: int,
                 rows_to_search: Optional[Sequence[int]] = None) -> Where:
    """Where ``slots`` (one node, page aligned) sit in the request rows (only
    ``rows_to_search`` when given): the place every row that holds all of them agrees on."""
    if req_to_token is None or slots.numel() == 0:
        return Where(None, None)
    rows = req_to_token
    s = slots.to(rows.device, rows.dtype).reshape(-1)
    heads = rows[:, ::page]
    if rows_to_search is not None:
        if not len(rows_to_search):
            return Where(None, None)
        which = torch.as_tensor(list(rows_to_search), dtype=torch.long)
        heads = heads.index_select(0, which.to(rows.device))
    hits = (heads == s[0]).nonzero().tolist()
    if rows_to_search is not None:
        hits = [(rows_to_search[i], c) for i, c in hits]
    places = set()
    n = s.numel()
    for r, c in hits:
        p = c * page
        if p + n <= rows.shape[1] and torch.equal(rows[r, p:p + n], s):
            places.add((p, int(rows[r, p - page]) if p >= page else None))
    if len(places) != 1:
        return Where(None, None)
    p, parent = places.pop()
    return Where(p, parent)


def signals_for(store, n: int, where: Where, parent_key: Optional[str]) -> list[WriteSignals]:
    """The signals of ``n`` pages written after ``parent_key`` (see the module docstring)."""
    c = continues(store, parent_key)
    ctx = where.context if where.context is not None else c.position_tokens
    return [WriteSignals(refcount=1, turn=c.turn, context_tokens=ctx,
                         prev_reply_tokens=c.prev_reply_tokens)] * n
