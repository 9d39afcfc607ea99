"""The host-memory arena for memory-placed blocks.

Fixed-size slots of one block each.  Pinned (page-locked, through torch) when CUDA is
present so device copies are asynchronous; plain memory otherwise, and ``pinned``
says which (``store.stats()["memory_pinned"]``).  ``alloc`` takes all the slots asked
for or none.
"""

from __future__ import annotations

import importlib.util
import logging

import numpy as np

log = logging.getLogger("sglang_flatcake")


def _cuda_present() -> bool:
    """Whether torch is installed and sees a CUDA device (no torch: False)."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch
    return bool(torch.cuda.is_available())


def pinned_or_plain(nbytes: int, cuda: bool | None = None) -> tuple[np.ndarray, object, bool]:
    """(flat uint8 array of ``nbytes``, the object that owns its memory, pinned?).

    With CUDA present (``cuda``, default: probed) the memory is a pinned torch tensor,
    which the caller must keep alive as long as the array (numpy arrays take no
    attributes, so the owner is returned, not attached).  A failed pin raises: a server
    that asked for pinned memory does not silently get pageable memory."""
    if not nbytes or not (_cuda_present() if cuda is None else cuda):
        return np.empty(nbytes, dtype=np.uint8), None, False
    import torch
    try:
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as e:
        raise RuntimeError(f"pinning the {nbytes}-byte memory arena failed: {e}") from None
    return t.numpy(), t, True


class HostArena:
    def __init__(self, capacity_bytes: int, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.slots = capacity_bytes // block_bytes if block_bytes else 0
        flat, self._owner, self.pinned = pinned_or_plain(self.slots * block_bytes)
        log.info("flatcake: memory arena of %d bytes in %s memory", flat.nbytes,
                 "pinned" if self.pinned else "pageable")
        self.buf = flat.reshape(self.slots, block_bytes) if self.slots else flat.reshape(0, block_bytes)
        self.owner = np.full(self.slots, -1, dtype=np.int64)
        self._free = list(range(self.slots - 1, -1, -1))

    @property
    def capacity_bytes(self) -> int:
        return self.slots * self.block_bytes

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_bytes(self) -> int:
        return (self.slots - len(self._free)) * self.block_bytes

    def alloc(self, n: int, owner: int) -> list[int] | None:
        """Take ``n`` slots for session ``owner``; ``None`` (nothing taken) if too few are free."""
        if n > len(self._free):
            return None
        got = [self._free.pop() for _ in range(n)]
        self.owner[got] = owner
        return got

    def free(self, slots: list[int]) -> None:
        self.owner[slots] = -1
        self._free.extend(slots)

    def slot_of(self, offset: int) -> int:
        return offset // self.block_bytes
