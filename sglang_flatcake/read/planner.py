"""Read planning: the blocks a request needs -> few large, sorted, aligned reads.

Every wanted (layer, block) range is sorted by (file, offset); adjacent ranges merge,
and gaps smaller than ``merge_gap`` are read through.  With ``split_layers`` (the
default) a command never spans two layers, so restoring layer l of a session written in
T turns takes at most T commands and a full restore at most layers x T.  Commands are
aligned outward to ``alignment``.  Each wanted range becomes a *piece*: where its bytes
sit inside its command's buffer, which request block and layer it fills, its checksum.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..io.base import ReadCommand
from ..layout import SegmentGeometry


@dataclass(frozen=True)
class SegmentRead:
    """Wanted blocks of one segment: ``index[i]`` of the segment fills request block ``dest[i]``."""

    path: str
    offset: int                  # file offset of the segment
    geometry: SegmentGeometry
    index: np.ndarray            # int64 block indices within the segment
    dest: np.ndarray             # int64 request block numbers
    checksums: np.ndarray        # (layers, len(index)) uint64


@dataclass(frozen=True)
class ReadPlan:
    commands: list[ReadCommand]
    command_layer: np.ndarray    # layer of each command (-1 when it spans layers)
    piece_cmd: np.ndarray        # per piece: command number
    piece_offset: np.ndarray     # byte offset of the piece inside its command buffer
    piece_dest: np.ndarray       # request block
    piece_layer: np.ndarray
    piece_checksum: np.ndarray
    piece_bytes: int             # every piece is one block-layer
    bytes_read: int
    bytes_wanted: int

    @property
    def read_commands(self) -> int:
        return len(self.commands)

    @property
    def gap_bytes(self) -> int:
        """Bytes read that no piece wanted (merged-through gaps and alignment)."""
        return self.bytes_read - self.bytes_wanted

    def commands_for_layer(self, layer: int) -> np.ndarray:
        return np.nonzero(self.command_layer == layer)[0]


def empty_plan(piece_bytes: int = 0) -> ReadPlan:
    z = np.empty(0, np.int64)
    return ReadPlan([], z, z, z, z, z, np.empty(0, np.uint64), piece_bytes, 0, 0)


def plan_reads(reads: list[SegmentRead], alignment: int, merge_gap: int,
               split_layers: bool = True) -> ReadPlan:
    """Turn wanted blocks into merged, sorted, aligned read commands."""
    if not reads:
        return empty_plan()
    layout = reads[0].geometry.layout
    blb = layout.block_layer_bytes
    paths = sorted({r.path for r in reads})
    pid_of = {p: i for i, p in enumerate(paths)}
    cols = {k: [] for k in ("pid", "start", "layer", "dest", "sum")}
    layers = np.arange(layout.layers, dtype=np.int64)
    for r in reads:
        g = r.geometry
        k = len(r.index)
        if k == 0:
            continue
        start = (r.offset + g.header_bytes + layers[:, None] * g.layer_stride
                 + np.asarray(r.index, np.int64)[None, :] * blb)
        cols["start"].append(start.reshape(-1))
        cols["pid"].append(np.full(start.size, pid_of[r.path], np.int64))
        cols["layer"].append(np.repeat(layers, k))
        cols["dest"].append(np.tile(np.asarray(r.dest, np.int64), layout.layers))
        cols["sum"].append(np.asarray(r.checksums, np.uint64).reshape(-1))
    if not cols["start"]:
        return empty_plan(blb)
    pid, start, layer, dest, csum = (np.concatenate(cols[k]) for k in
                                     ("pid", "start", "layer", "dest", "sum"))
    order = np.lexsort((start, pid))
    pid, start, layer, dest, csum = pid[order], start[order], layer[order], dest[order], csum[order]
    a0 = start // alignment * alignment
    a1 = -(-(start + blb) // alignment) * alignment
    # a monotone key across files: shift each file far apart so running maxima never mix
    span = np.int64(1) << np.int64(50)
    key_end = a1 + pid * span
    prev_max = np.maximum.accumulate(key_end)
    new = np.ones(len(start), dtype=bool)
    gap = (a0[1:] + pid[1:] * span) - prev_max[:-1]
    new[1:] = gap >= max(merge_gap, 1)
    new[1:] |= pid[1:] != pid[:-1]
    if split_layers:
        new[1:] |= layer[1:] != layer[:-1]
    cmd = np.cumsum(new) - 1
    firsts = np.nonzero(new)[0]
    cstart = a0[firsts]
    cend = np.maximum.reduceat(a1, firsts)
    if split_layers:
        clayer = layer[firsts]
    else:
        same = np.minimum.reduceat(layer, firsts) == np.maximum.reduceat(layer, firsts)
        clayer = np.where(same, layer[firsts], -1)
    cpid = pid[firsts]
    commands = [ReadCommand(paths[p], int(s), int(e - s)) for p, s, e in zip(cpid, cstart, cend)]
    return ReadPlan(
        commands=commands, command_layer=clayer.astype(np.int64), piece_cmd=cmd.astype(np.int64),
        piece_offset=(start - cstart[cmd]).astype(np.int64), piece_dest=dest, piece_layer=layer,
        piece_checksum=csum, piece_bytes=blb,
        bytes_read=int((cend - cstart).sum()), bytes_wanted=int(len(start) * blb))
