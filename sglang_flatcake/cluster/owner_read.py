"""The owner's reads: a granted run sealed into its staging slot (``stage_run``), and the
publish-time records of what the store wrote (``publish_records``).

SSD blocks are read (O_DIRECT) into a plaintext staging area that is never registered;
then every block -- those from SSD and the memory tier's straight from the host arena -- is
sealed (``seal``: encrypted and authenticated for this grant) into the slot, the only memory
registered with the Transfer Engine, and only for the grant.  The grant names *segments*
(consecutive sealed blocks of the slot, one Transfer Engine read each; one segment for a
whole run).  The run's read lease stays held by the caller until the ack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import xxhash

from .secret import ClusterSecret
from .wire import block_record, plan_checksums


@dataclass(frozen=True)
class StagedRun:
    hits: int                               # leading blocks staged (verified by the requester)
    segments: list[tuple[int, int, int]]    # (first block of the run, remote address, bytes)
    from_ssd: int
    read_commands: int
    memory: tuple[int, ...] = ()            # leading blocks sealed straight from the arena


def stage_run(store, lease, view: np.ndarray, sealed: np.ndarray,
              seal: Callable[[int, np.ndarray, np.ndarray], None]) -> StagedRun:
    """Read ``lease``'s SSD blocks into ``view`` (``(n, layers, block_layer_bytes)``, never
    registered), then ``seal(i, plain, sealed[i])`` each leading good block, from ``view`` or
    the arena (``sealed`` is ``(n, sealed bytes)``, registered by the caller at its address
    afterwards).  Records the read on the lease.  An I/O error is recorded and raised
    (``IOEngineError``).  Nothing is hashed here: the requester checks the bytes against the
    writer's publish-time records."""
    n = lease.n
    bad = np.zeros(n, dtype=bool)
    plan = lease.plan()
    try:
        store.reader.read_into(plan, view[:n], bad, False)
    except OSError:
        lease.record(plan, 0, read_error=True)
        raise
    badi = np.nonzero(bad)[0]
    hits = int(badi[0]) if len(badi) else n
    lease.record(plan, hits, int(bad.sum()))
    memory = dict(lease.memory)
    for i in range(hits):
        seal(i, lease.arena_buf[memory[i]] if i in memory else view[i], sealed[i])
    segments = [(0, sealed.ctypes.data, hits * sealed.shape[1])] if hits else []
    return StagedRun(hits, segments, hits - lease.memory_hits(hits), plan.read_commands,
                     tuple(sorted(i for i in memory if i < hits)))


def publish_records(store, secret: ClusterSecret, tag: str, keys: list[str]) -> list[str]:
    """The records (``wire.block_record``) of the leading stored run of ``keys``, from the
    checksums the store wrote with each SSD block and a hash of each memory-tier block taken
    now, right after its ``put`` (the arena slot is never writable by peers).  No I/O."""
    layers = store.layout.layers
    with store.read_lease(keys) as lease:
        n = lease.n
        sums = plan_checksums(lease.plan(), n, layers)
        h = xxhash.xxh3_64_intdigest
        for d, s in lease.memory:
            sums[d] = [h(part) for part in lease.arena_buf[s].reshape(layers, -1)]
    return [block_record(secret, tag, k, sums[i]) for i, k in enumerate(keys[:n])]
