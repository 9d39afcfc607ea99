"""flatcake-linker: the real FlatCake store behind SGLang's direct external linker."""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..layerwise import pipeline_end
from .base import RequestState
from .flatcake import FlatCake


class FlatCakeLinker(FlatCake):
    """flatcake-linker: the same store, placement and writes as ``flatcake``, served the way
    ``sglang.linker.FlatCakeLinker`` serves it: no host tier, and no restore ahead of the
    forward.  A request is ready at arrival; its memory-tier pages are copied to the device
    when its prefill starts, then its SSD part is read layer by layer while the prefill runs
    (``layerwise.pipeline_end``: layer l's prefill waits for layer l's KV and layer l-1's
    prefill), so the restore holds the GPU but hides under the compute.

    Restore or recompute, as the linker's ``lookup`` decides it: the SSD part is cut (served
    its memory pages before the first SSD page, the rest recomputed) when the layer-wise
    restore alone would end later than recomputing the SSD part (both on the same GPU, so
    the queue ahead of the request does not enter).  Restores never wait in the
    SSD-preparing queue here (``needs_restore`` stays False), so with one prefill at a time
    every policy admits in arrival order.
    """

    name = "flatcake-linker"
    policy = "two-queue"
    layer_wise = True

    def open(self, ctx) -> None:
        super().open(ctx)
        self._pending: set[int] = set()          # rids whose SSD part is read in the prefill
        self.io.extra.update(layer_wise_restores=0, recompute_cuts=0, layer_wise_short=0)

    def restore_rate(self) -> float | None:
        """None: the replayer's decision does not apply; ``lookup`` cuts instead."""
        return None

    def lookup(self, rs: RequestState) -> None:
        super().lookup(rs)
        if not rs.needs_restore:
            return
        tokens = self._ssd_tokens(rs)
        if self._recompute_sooner(rs, tokens):
            self.decline_restore(rs)
            rs.recomputed_tokens = tokens
            self.io.extra["recompute_cuts"] += 1
            return
        rs.needs_restore = False                 # ready now: read inside the prefill
        self._pending.add(rs.req.rid)

    def _ssd_tokens(self, rs: RequestState) -> int:
        bt, n = self.ctx.sizing.block_tokens, rs.req.input_tokens
        return min(n, rs.n_found * bt) - min(n, rs.lead_memory * bt)

    def _recompute_sooner(self, rs: RequestState, ssd_tokens: int) -> bool:
        tps = self.ctx.prefill_tps
        if tps <= 0:
            return False
        rest = max(0, rs.req.input_tokens - rs.n_found * self.ctx.sizing.block_tokens)
        load = self.ctx.disk_model.read_s(rs.restore_bytes, 0)
        restore = pipeline_end(0.0, 0.0, load, rest / tps, self.ctx.sizing.model.layers)
        return restore > (rest + ssd_tokens) / tps

    def begin_prefill(self, rs: RequestState) -> None:
        if rs.req.rid not in self._pending:
            super().begin_prefill(rs)
            return
        n, lease = rs.n_found, rs.sys.lease
        rs.delivered = n                          # every layer lands before its prefill
        rs.delivered_ssd = len(lease.ssd)
        self.io.ssd_bytes_delivered += rs.delivered_ssd * self.ctx.sizing.block_bytes
        rs.h2d_full_bytes = (n - rs.delivered_ssd) * self.ctx.sizing.full_block_bytes

    def read_layers(self, rs: RequestState, landed: Callable[[], None]) -> bool:
        """Read ``rs``'s SSD part now (real reads, the shared disk's time); ``landed()`` when
        the last layer is in.  False for a request with nothing to read."""
        rid = rs.req.rid
        if rid not in self._pending:
            return False
        self._pending.discard(rid)
        r = rs.sys
        out = self.store.alloc_blocks(rs.n_found)
        plan = r.lease.plan()
        bad = np.zeros(rs.n_found, dtype=bool)
        fut = self._threads.submit(self._execute, r, plan, out, bad)
        self.io.ssd_bytes_read += plan.bytes_read
        self.io.read_commands += plan.read_commands
        self.io.extra["layer_wise_restores"] += 1

        def joined() -> None:
            self._join(rs, fut)
            if r.hits < rs.n_found:               # a damaged block: the server aborts, counted
                self.io.extra["layer_wise_short"] += 1
        self.submit_read(plan.bytes_read, plan.read_commands * self.ctx.sizing.layer_factor,
                         joined, landed)
        return True
