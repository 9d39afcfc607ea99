"""Values the TP ranks agree on before they decide (both modes): each rank sees its own store
but all must build the same batches.  A collective: every rank makes the same calls in order.
"""

from __future__ import annotations

import torch


class RankAgreement:
    """``agree(values, op)``: ``values`` reduced (``"min"`` | ``"max"``) over ``group``'s
    ranks, as floats (exact for integers below 2**53); unchanged with no group or one rank."""

    def __init__(self, group=None) -> None:
        dist = torch.distributed
        alone = group is None or not (dist.is_available() and dist.is_initialized()) \
            or dist.get_world_size(group=group) == 1
        self.group = None if alone else group

    def __call__(self, values: list, op: str = "max") -> list:
        if op not in ("min", "max"):
            raise ValueError(f"op={op!r} is not allowed: expected 'min' or 'max'")
        if self.group is None or not values:
            return list(values)
        dist = torch.distributed
        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX,
                        group=self.group)
        return t.tolist()
