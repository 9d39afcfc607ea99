"""How a read plan fills the window: ``plan_fills`` cuts the plan's commands into
``Fill``s, one buffer's worth each (``capacity`` bytes), in layer order (every fill one
layer, the order the scatter wants) or in plan order.  A command longer than a buffer is
split at piece boundaries (``_split``); each command starts at an aligned window offset."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..io.base import ReadCommand
from ..layout import align_down, align_up
from .planner import ReadPlan


@dataclass(frozen=True)
class Fill:
    """One buffer's worth of reads: commands at window offsets, and their pieces."""

    layers: tuple[int, ...]           # layer of each command (all one layer in layer order)
    commands: tuple[ReadCommand, ...]
    offsets: tuple[int, ...]          # window byte offset of each command
    piece_src: np.ndarray             # window byte offset of each piece
    piece_dest: np.ndarray            # request block of each piece
    piece_checksum: np.ndarray
    bounds: tuple[int, ...]           # pieces of command i are [bounds[i], bounds[i + 1])
    nbytes: int                       # window bytes used


def plan_fills(plan: ReadPlan, capacity: int, alignment: int, order: str = "layer") -> list[Fill]:
    """Pack the plan's commands into fills of at most ``capacity`` bytes.

    ``order="layer"``: layer by layer, a fill never mixing layers (what a layer-wise
    consumer needs).  ``order="file"``: the plan's (file, offset) order, a fill mixing
    layers; for restores nothing reads before they end (sequential reads on the disk).
    Raises ``ValueError`` for a plan whose commands span layers (``split_layers=False``),
    an unknown order, or a capacity that cannot hold one piece.
    """
    if len(plan.command_layer) and int(plan.command_layer.min()) < 0:
        raise ValueError("plan has commands spanning layers; plan it with split_layers=True")
    if order not in ("layer", "file"):
        raise ValueError(f"order={order!r} is not allowed: layer or file")
    pb = plan.piece_bytes
    by_cmd = np.lexsort((plan.piece_offset, plan.piece_cmd))
    starts = np.searchsorted(plan.piece_cmd[by_cmd], np.arange(len(plan.commands) + 1))
    groups = ([plan.commands_for_layer(int(lay)) for lay in np.unique(plan.command_layer)]
              if order == "layer" else [np.arange(len(plan.commands))])
    fills: list[Fill] = []
    for group in groups:
        cur: list = []                 # (command, window offset, piece ids, local offsets, layer)
        used = 0

        def close():
            nonlocal cur, used
            if cur:
                ids = np.concatenate([c[2] for c in cur])
                src = np.concatenate([c[3] + c[1] for c in cur])
                bounds = tuple(np.cumsum([0] + [len(c[2]) for c in cur]).tolist())
                fills.append(Fill(tuple(c[4] for c in cur), tuple(c[0] for c in cur),
                                  tuple(c[1] for c in cur), src, plan.piece_dest[ids],
                                  plan.piece_checksum[ids], bounds, used))
            cur, used = [], 0

        for ci in group:
            layer = int(plan.command_layer[ci])
            ids = by_cmd[starts[ci]:starts[ci + 1]]
            for sub, sub_ids, local in _split(plan.commands[ci], ids, plan.piece_offset[ids],
                                              pb, capacity, alignment):
                off = align_up(used, alignment)
                if off + sub.length > capacity:
                    close()
                    off = 0
                cur.append((sub, off, sub_ids, local, layer))
                used = off + sub.length
        close()
    return fills


def _split(cmd: ReadCommand, ids: np.ndarray, offs: np.ndarray, pb: int, capacity: int,
           a: int):
    """Cut a command into aligned sub-commands of at most ``capacity`` bytes, between pieces."""
    if cmd.length <= capacity:
        return [(cmd, ids, offs)]
    out, i, k = [], 0, len(ids)
    while i < k:
        start = align_down(int(offs[i]), a)
        j = i
        while j < k and align_up(int(offs[j]) + pb, a) - start <= capacity:
            j += 1
        if j == i:
            raise ValueError(f"window buffers of {capacity} bytes cannot hold one piece of {pb} "
                             f"bytes at alignment {a}; use at least {align_up(pb, a) + a}")
        end = min(align_up(int(offs[j - 1]) + pb, a), cmd.length)
        out.append((ReadCommand(cmd.path, cmd.offset + start, end - start), ids[i:j],
                    offs[i:j] - start))
        i = j
    return out
