"""``FlatCakeStore.get``: the leading stored run of keys into one host buffer.

``get(core, reader, keys, out)`` works on the store core (``store_core.StoreCore``):
memory blocks are copied, SSD blocks read through ``reader`` (the store's
``VectoredReader``: one plan, merged commands), both under one read lease.  A block whose checksum
fails is a miss (it and everything after it), never wrong bytes; an I/O error fails
the whole read (``hits == 0``), logged and counted.  A key list with repeats is
read once per distinct key and copied where asked.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from ..errors import IOEngineError
from ..results import GetResult
from ..store_checks import as_blocks, repeated
from ..store_core import StoreCore
from .promote import promote_shared
from .read_lease import open_lease
from .restore import VectoredReader

log = logging.getLogger("sglang_flatcake")


def get(core: StoreCore, reader: VectoredReader, keys: Sequence[str],
        out: np.ndarray) -> GetResult:
    """``out``: checked C-contiguous, any shape whose bytes are ``len(keys)`` blocks."""
    again = repeated(keys)
    if again is not None:
        return _get_repeated(core, reader, keys, again, out)
    n_keys = len(keys)
    out = as_blocks(core.layout, out, n_keys) if n_keys else out
    with open_lease(core, keys) as lease:
        bad = np.zeros(lease.n, dtype=bool)
        lease.copy_memory(out)
        plan = lease.plan()
        try:
            reader.read_into(plan, out, bad, core.config.verify_reads)
        except IOEngineError as e:
            log.warning("flatcake: read failed, served as a miss: %s", e)
            lease.record(plan, 0, read_error=True)
            return GetResult(0, 0, 0, plan.read_commands, plan.bytes_read, plan.bytes_wanted, 0)
        badi = np.nonzero(bad)[0]
        hits = int(badi[0]) if len(badi) else lease.n
        promote_shared(core, lease, out, hits)
    lease.record(plan, hits, int(bad.sum()))
    mem_hits = lease.memory_hits(hits)
    return GetResult(hits, mem_hits, hits - mem_hits, plan.read_commands, plan.bytes_read,
                     plan.bytes_wanted, int(bad.sum()))


def _get_repeated(core: StoreCore, reader: VectoredReader, keys: Sequence[str], again,
                  out: np.ndarray) -> GetResult:
    distinct, pos = again
    lay = core.layout
    out = as_blocks(lay, out, len(keys))
    tmp = reader.engine.alloc(len(distinct) * lay.block_bytes).reshape(
        len(distinct), lay.layers, lay.block_layer_bytes)
    g = get(core, reader, distinct, tmp)
    late = np.nonzero(pos >= g.hits)[0]
    hits = int(late[0]) if len(late) else len(keys)
    out[:hits] = tmp[pos[:hits]]
    return GetResult(hits, g.from_memory, g.from_ssd, g.read_commands, g.bytes_read,
                     g.bytes_wanted, g.corrupt)
