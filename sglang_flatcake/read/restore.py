"""Executing a read plan on the CPU path: vectored reads straight into place.

Each command's bytes are scattered by one ``preadv`` over the destination
block-layer slots (and a scratch buffer for bytes read through gaps), so the
SSD data lands where the caller wants it with no staging copy.  Every command
is in flight at once; each is verified as it lands.
"""

from __future__ import annotations

import numpy as np
import xxhash

from ..errors import IOEngineError
from ..io.base import IOEngine
from .planner import ReadPlan


class VectoredReader:
    def __init__(self, engine: IOEngine, merge_gap: int) -> None:
        self.engine = engine
        self._junk_buf = engine.alloc(merge_gap + 4 * engine.alignment)

    def _junk(self, nbytes: int) -> np.ndarray:
        """Scratch space for bytes read through (gaps, alignment); contents are discarded."""
        if self._junk_buf.nbytes < nbytes:
            self._junk_buf = self.engine.alloc(max(nbytes, 2 * self._junk_buf.nbytes))
        return self._junk_buf[:nbytes]

    def read_into(self, plan: ReadPlan, out: np.ndarray, bad: np.ndarray, verify: bool) -> None:
        """Fill ``out[dest, layer]`` for every piece of ``plan``.

        ``out`` is ``(n, layers, block_layer_bytes)`` uint8 (aligned for zero-copy).
        Sets ``bad[dest]`` for a piece whose checksum does not match.  Raises
        ``IOEngineError`` (after every command has finished) if any read failed.
        """
        if not plan.commands:
            return
        order = np.lexsort((plan.piece_offset, plan.piece_cmd))
        starts = np.searchsorted(plan.piece_cmd[order], np.arange(len(plan.commands) + 1))
        pb = plan.piece_bytes

        def scatter(ci: int) -> list[np.ndarray]:
            iov, cur = [], 0
            for j in order[starts[ci]:starts[ci + 1]]:
                o = int(plan.piece_offset[j])
                if o > cur:
                    iov.append(self._junk(o - cur))
                iov.append(out[plan.piece_dest[j], plan.piece_layer[j]])
                cur = o + pb
            if cur < plan.commands[ci].length:
                iov.append(self._junk(plan.commands[ci].length - cur))
            return iov

        handles = self.engine.submit(plan.commands, [scatter(i) for i in range(len(plan.commands))])
        h = xxhash.xxh3_64_intdigest
        first: IOEngineError | None = None
        for ci, handle in enumerate(handles):
            try:
                handle.wait()
            except IOEngineError as e:
                first = first or e
                continue
            if first is None and verify:
                for j in order[starts[ci]:starts[ci + 1]]:
                    d = plan.piece_dest[j]
                    if h(out[d, plan.piece_layer[j]]) != int(plan.piece_checksum[j]):
                        bad[d] = True
        if first is not None:
            raise first
