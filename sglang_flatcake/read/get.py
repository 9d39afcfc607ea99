"""``FlatCakeStore.get``: the leading stored run of keys into one host buffer.

Memory blocks are copied, SSD blocks read through the store's ``VectoredReader``
(one plan, merged commands), both under one read lease.  A block whose checksum
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
from .promote import promote_shared

log = logging.getLogger("sglang_flatcake")


def get(st, keys: Sequence[str], out: np.ndarray) -> GetResult:
    """``out``: checked C-contiguous, any shape whose bytes are ``len(keys)`` blocks."""
    again = repeated(keys)
    if again is not None:
        return _get_repeated(st, keys, again, out)
    n_keys = len(keys)
    out = as_blocks(st.layout, out, n_keys) if n_keys else out
    with st.read_lease(keys) as lease:
        bad = np.zeros(lease.n, dtype=bool)
        lease.copy_memory(out)
        plan = lease.plan()
        try:
            st.reader.read_into(plan, out, bad, st.config.verify_reads)
        except IOEngineError as e:
            log.warning("flatcake: read failed, served as a miss: %s", e)
            lease.record(plan, 0, read_error=True)
            return GetResult(0, 0, 0, plan.read_commands, plan.bytes_read, plan.bytes_wanted, 0)
        badi = np.nonzero(bad)[0]
        hits = int(badi[0]) if len(badi) else lease.n
        promote_shared(st.table, st._meta, st.config.shared_refcount, st.counters, lease,
                       out, hits)
    lease.record(plan, hits, int(bad.sum()))
    mem_hits = lease.memory_hits(hits)
    return GetResult(hits, mem_hits, hits - mem_hits, plan.read_commands, plan.bytes_read,
                     plan.bytes_wanted, int(bad.sum()))


def _get_repeated(st, keys: Sequence[str], again, out: np.ndarray) -> GetResult:
    distinct, pos = again
    out = as_blocks(st.layout, out, len(keys))
    tmp = st.alloc_blocks(len(distinct))
    g = st.get(distinct, tmp)
    late = np.nonzero(pos >= g.hits)[0]
    hits = int(late[0]) if len(late) else len(keys)
    out[:hits] = tmp[pos[:hits]]
    return GetResult(hits, g.from_memory, g.from_ssd, g.read_commands, g.bytes_read,
                     g.bytes_wanted, g.corrupt)
