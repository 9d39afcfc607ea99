"""The owner/requester wire protocol: JSON messages over a ZeroMQ REQ/REP pair, and the
per-(block, layer) checksums a grant carries.

Protocol (JSON over a ZeroMQ REP socket bound to the operator's address):

- ``{"op": "fetch", "tenant": T, "keys": [...]}`` -> ``{"hits": n, "lease": id, "peer": te,
  "addr": a, "bytes": b, "segments": [[first block, address, bytes], ...], "checksums":
  [[...] per block]}``.  The owner reads the leading stored run of ``keys`` that ``T``
  published (``owner_read.stage_run``: merged O_DIRECT reads of the SSD pieces, one command
  per merged range, straight into a registered staging slot at ``a``; memory-tier blocks stay
  in the store's registered arena) and holds the slot and the run's read lease for the
  requester until it acks or ``lease_s`` passes.  Each segment is one transfer: consecutive
  SSD blocks in the slot, or consecutive arena slots (one segment ``[0, a, b]`` for a run all
  on SSD).  ``hits == 0`` is a miss (not stored, another tenant's keys, or every slot busy).
  Checksums are the store's own for SSD blocks (written with the segment; the owner does not
  hash the bytes it reads, the requester checks them where they land) and hashed from the
  arena for memory blocks.
- ``{"op": "ack", "lease": id}`` -> ``{"valid": bool}``: frees the slot; ``valid`` is true
  only when the lease was still held (the slot was not reused) *and* the store still holds
  the run (``exists``): a session reclaimed while the transfer ran is a miss, never served.
"""

from __future__ import annotations

import numpy as np
import xxhash


def fetch_request(tenant: str, keys: list[str]) -> dict:
    """Ask for the leading stored run of ``keys`` that ``tenant`` may read."""
    return {"op": "fetch", "tenant": tenant, "keys": keys}


def ack_request(lease: int) -> dict:
    """Give a grant's slot back; the reply says whether the run was valid throughout."""
    return {"op": "ack", "lease": lease}


def block_checksums(blocks: np.ndarray, known: np.ndarray | None = None) -> list[list[int]]:
    """xxh3_64 of every (block, layer) of ``(n, layers, block_layer_bytes)``, as the store
    writes them; a nonzero ``known[i, j]`` (the store's own checksum) is taken as is."""
    h = xxhash.xxh3_64_intdigest
    n, layers = blocks.shape[:2]
    return [[int(known[i, j]) if known is not None and known[i, j] else h(blocks[i, j])
             for j in range(layers)] for i in range(n)]


def plan_checksums(plan, n: int, layers: int) -> np.ndarray:
    """``(n, layers)`` uint64: each SSD piece's stored checksum from a read ``plan``, 0 elsewhere."""
    known = np.zeros((n, layers), np.uint64)
    keep = plan.piece_dest < n
    known[plan.piece_dest[keep], plan.piece_layer[keep]] = plan.piece_checksum[keep]
    return known
