"""The host-memory arena for memory-placed blocks.

Fixed-size slots of one block each.  Pinned (page-locked) when CUDA is
present so device copies are asynchronous; plain memory otherwise.  ``alloc``
takes all the slots asked for or none.
"""

from __future__ import annotations

import numpy as np


def _pinned_or_plain(nbytes: int) -> tuple[np.ndarray, bool]:
    try:
        import torch  # noqa: PLC0415 - optional
        if torch.cuda.is_available() and nbytes:
            t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            arr = t.numpy()
            arr._flatcake_owner = t  # type: ignore[attr-defined]  # keep the tensor alive
            return arr, True
    except Exception:  # torch missing or no driver: plain memory
        pass
    return np.empty(nbytes, dtype=np.uint8), False


class HostArena:
    def __init__(self, capacity_bytes: int, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.slots = capacity_bytes // block_bytes if block_bytes else 0
        flat, self.pinned = _pinned_or_plain(self.slots * block_bytes)
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
