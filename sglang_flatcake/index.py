"""Compact hash index: block key -> opaque 64-bit address.

Keys are reduced to a 128-bit fingerprint (``keys.key_digest``), held as two
little-endian uint64 words ``(d0, d1)``; two keys with equal fingerprints are the same
key as far as the index is concerned.

Storage is open addressing with linear probing over two numpy arrays:
``keys`` (capacity, 2) uint64 and ``vals`` (capacity,) uint64, i.e. 24 bytes a
slot.  Slot markers are reserved fingerprints: EMPTY = (0, 0) and
TOMBSTONE = (0, 1).  A real fingerprint (0, 0) or (0, 1) is remapped to
(0, 2) or (0, 3) before use, so it aliases that digest (p ~ 2**-127);
``items_digests`` reports the remapped value.
Capacity is a power of two; when an insert would make live + tombstones exceed
0.75 * capacity the table is rebuilt: at the same capacity when tombstones fill
at least 1/8 of it (load after rebuild <= 0.625), else at double capacity.
Removal leaves a tombstone, except that a run of tombstones ending right before
an empty slot is turned back into empty slots.  The table never shrinks except
through ``clear()``.

All probing loops are numba-compiled batch kernels.  ``KeyIndex`` is NOT
thread-safe: the caller must serialise every call (reads included) with a lock.
"""

from __future__ import annotations

import operator
from typing import Sequence

import numpy as np
from numba import njit

from .keys import _digest_rows

__all__ = ["KeyIndex"]

_U64 = np.uint64
_ZERO, _ONE, _TWO = _U64(0), _U64(1), _U64(2)
_K1 = _U64(0x9E3779B97F4A7C15)  # Fibonacci hashing multiplier
_K2 = _U64(0xC2B2AE3D27D4EB4F)
_MIN_CAPACITY = 8
_MAX_ADDRESS = 2**64


# ---------------------------------------------------------------- kernels
# q arrays are C-contiguous (n, >=2) uint64; only columns 0 and 1 are read.


@njit(cache=True)
def _fix(d0, d1):
    """Remap the reserved fingerprints (0, 0) / (0, 1) to (0, 2) / (0, 3)."""
    return d1 + _TWO if d0 == _ZERO and d1 <= _ONE else d1


@njit(cache=True)
def _find(tkeys, d0, d1, s):
    """Slot holding (d0, d1) (already remapped), or -1."""
    mask = tkeys.shape[0] - 1
    j = np.intp(((d0 ^ (d1 * _K2)) * _K1) >> s)
    while True:
        k0, k1 = tkeys[j, 0], tkeys[j, 1]
        if k0 == d0 and k1 == d1:
            return j
        if k0 == _ZERO and k1 == _ZERO:
            return -1
        j = (j + 1) & mask


@njit(cache=True)
def _lookup_kernel(tkeys, tvals, shift, q, out_addr, out_found):
    s = np.uint64(shift)
    for i in range(q.shape[0]):
        j = _find(tkeys, q[i, 0], _fix(q[i, 0], q[i, 1]), s)
        out_found[i] = j >= 0
        out_addr[i] = tvals[j] if j >= 0 else _ZERO


@njit(cache=True)
def _prefix_kernel(tkeys, shift, q):
    s = np.uint64(shift)
    for i in range(q.shape[0]):
        if _find(tkeys, q[i, 0], _fix(q[i, 0], q[i, 1]), s) < 0:
            return i
    return q.shape[0]


@njit(cache=True)
def _insert_kernel(tkeys, tvals, shift, q, addrs, start, limit, counts):
    """Insert/overwrite q[start:], stopping before a key that could push
    live + tomb over ``limit``.  counts = [live, tomb]; returns next index."""
    mask = tkeys.shape[0] - 1
    s = np.uint64(shift)
    i = start
    while i < q.shape[0] and counts[0] + counts[1] < limit:
        d0 = q[i, 0]
        d1 = _fix(d0, q[i, 1])
        j = np.intp(((d0 ^ (d1 * _K2)) * _K1) >> s)
        first_tomb = -1
        while True:
            k0, k1 = tkeys[j, 0], tkeys[j, 1]
            if k0 == d0 and k1 == d1:
                break
            if k0 == _ZERO and k1 == _ZERO:
                if first_tomb >= 0:
                    j = first_tomb
                    counts[1] -= 1
                tkeys[j, 0] = d0
                tkeys[j, 1] = d1
                counts[0] += 1
                break
            if k0 == _ZERO and k1 == _ONE and first_tomb < 0:
                first_tomb = j
            j = (j + 1) & mask
        tvals[j] = addrs[i]
        i += 1
    return i


@njit(cache=True)
def _remove_kernel(tkeys, tvals, shift, q, counts):
    mask = tkeys.shape[0] - 1
    s = np.uint64(shift)
    removed = 0
    for i in range(q.shape[0]):
        j = _find(tkeys, q[i, 0], _fix(q[i, 0], q[i, 1]), s)
        if j < 0:
            continue
        removed += 1
        tkeys[j, 0], tkeys[j, 1], tvals[j] = _ZERO, _ONE, _ZERO
        counts[0] -= 1
        counts[1] += 1
        nxt = (j + 1) & mask
        if tkeys[nxt, 0] == _ZERO and tkeys[nxt, 1] == _ZERO:
            # No probe chain passes beyond this run of tombstones: empty it.
            while tkeys[j, 0] == _ZERO and tkeys[j, 1] == _ONE:
                tkeys[j, 1] = _ZERO
                counts[1] -= 1
                j = (j - 1) & mask
    return removed


@njit(cache=True)
def _rehash_kernel(okeys, ovals, nkeys, nvals, shift):
    mask = nkeys.shape[0] - 1
    s = np.uint64(shift)
    for i in range(okeys.shape[0]):
        d0, d1 = okeys[i, 0], okeys[i, 1]
        if d0 == _ZERO and d1 <= _ONE:
            continue
        j = np.intp(((d0 ^ (d1 * _K2)) * _K1) >> s)
        while nkeys[j, 0] != _ZERO or nkeys[j, 1] != _ZERO:
            j = (j + 1) & mask
        nkeys[j, 0], nkeys[j, 1], nvals[j] = d0, d1, ovals[i]


@njit(cache=True)
def _items_kernel(tkeys, tvals, out_keys, out_vals):
    n = 0
    for i in range(tkeys.shape[0]):
        if tkeys[i, 0] != _ZERO or tkeys[i, 1] > _ONE:
            out_keys[n, 0], out_keys[n, 1], out_vals[n] = tkeys[i, 0], tkeys[i, 1], tvals[i]
            n += 1
    return n


# ---------------------------------------------------------------- helpers


def _as_digests(digests) -> np.ndarray:
    d = np.ascontiguousarray(digests, dtype=np.uint64)
    if d.ndim != 2 or d.shape[1] != 2:
        raise ValueError(f"digests must have shape (n, 2), got {d.shape}")
    return d


def _as_addresses(addresses, n: int) -> np.ndarray:
    """``addresses`` (length n) as contiguous uint64; ValueError naming an
    out-of-range value, TypeError for non-integers."""
    if isinstance(addresses, np.ndarray) and addresses.dtype.kind in "iub":
        if addresses.dtype.kind == "i" and addresses.size and addresses.min() < 0:
            raise ValueError(f"address {int(addresses.min())} out of range [0, 2**64)")
        a = np.ascontiguousarray(addresses, dtype=np.uint64)
    else:  # Python ints (numpy would turn [0, 2**63] into float64), objects
        seq = addresses.tolist() if isinstance(addresses, np.ndarray) else addresses
        vals = [operator.index(v) for v in seq]
        for v in (min(vals, default=0), max(vals, default=0)):
            if not 0 <= v < _MAX_ADDRESS:
                raise ValueError(f"address {v} out of range [0, 2**64)")
        a = np.array(vals, dtype=np.uint64)
    if a.shape != (n,):
        raise ValueError(f"need {n} addresses, got shape {a.shape}")
    return a


class KeyIndex:
    """Hash index from block keys to uint64 addresses (not thread-safe)."""

    def __init__(self, initial_capacity: int = 1024):
        cap = max(_MIN_CAPACITY, 1 << (max(int(initial_capacity), 1) - 1).bit_length())
        self._initial_capacity = cap
        self._allocate(cap)

    def _allocate(self, cap: int) -> None:
        self._keys = np.zeros((cap, 2), dtype=np.uint64)
        self._vals = np.zeros(cap, dtype=np.uint64)
        self._shift = 64 - (cap.bit_length() - 1)
        self._limit = cap * 3 // 4
        self._counts = np.zeros(2, dtype=np.int64)  # [live, tombstones]

    def _rebuild(self) -> None:
        live, tomb = int(self._counts[0]), int(self._counts[1])
        cap = self.capacity
        new_cap = cap if tomb >= cap // 8 else cap * 2
        okeys, ovals = self._keys, self._vals
        self._allocate(new_cap)
        _rehash_kernel(okeys, ovals, self._keys, self._vals, self._shift)
        self._counts[0] = live

    # -- size
    def __len__(self) -> int:
        return int(self._counts[0])

    @property
    def capacity(self) -> int:
        """Number of slots (a power of two)."""
        return self._keys.shape[0]

    @property
    def tombstones(self) -> int:
        """Slots holding a tombstone."""
        return int(self._counts[1])

    @property
    def nbytes(self) -> int:
        """Bytes held by the table arrays."""
        return self._keys.nbytes + self._vals.nbytes + self._counts.nbytes

    # -- reads (never mutate)
    def _lookup_rows(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        addr = np.empty(q.shape[0], dtype=np.uint64)
        found = np.empty(q.shape[0], dtype=np.bool_)
        _lookup_kernel(self._keys, self._vals, self._shift, q, addr, found)
        return addr, found

    def lookup_digests(self, digests: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(addresses uint64, found bool) for (n, 2) uint64 digests; a miss
        gives address 0 and found False."""
        return self._lookup_rows(_as_digests(digests))

    def lookup(self, keys: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Like ``lookup_digests`` for str keys."""
        return self._lookup_rows(_digest_rows(keys))

    def get(self, key: str) -> int | None:
        """Address of ``key``, or None on a miss."""
        addr, found = self._lookup_rows(_digest_rows([key]))
        return int(addr[0]) if found[0] else None

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def prefix_hits(self, keys: Sequence[str]) -> int:
        """Length of the leading run of ``keys`` that are present (0 if keys[0] misses)."""
        return int(_prefix_kernel(self._keys, self._shift, _digest_rows(keys)))

    def items_digests(self) -> tuple[np.ndarray, np.ndarray]:
        """(digests (n, 2) uint64, addresses uint64) of all live entries, in slot
        order; fresh arrays.  Digests are as stored (see remapping above)."""
        dk = np.empty((len(self), 2), dtype=np.uint64)
        dv = np.empty(len(self), dtype=np.uint64)
        got = _items_kernel(self._keys, self._vals, dk, dv)
        assert got == len(self), (got, len(self))
        return dk, dv

    # -- writes
    def _put_rows(self, q: np.ndarray, addresses) -> None:
        a = _as_addresses(addresses, q.shape[0])
        i = 0
        while True:
            i = _insert_kernel(self._keys, self._vals, self._shift, q, a, i, self._limit, self._counts)
            if i >= q.shape[0]:
                return
            self._rebuild()

    def put_digests(self, digests: np.ndarray, addresses) -> None:
        """Insert or overwrite each (digest, address); within a batch the last
        duplicate wins.  May grow or rebuild the table.  ValueError on an
        address outside [0, 2**64) or a length mismatch (nothing is stored)."""
        self._put_rows(_as_digests(digests), addresses)

    def put_many(self, keys: Sequence[str], addresses) -> None:
        """``put_digests`` for str keys."""
        self._put_rows(_digest_rows(keys), addresses)

    def put(self, key: str, address: int) -> None:
        """Insert or overwrite one key; ValueError naming ``address`` if it is
        not in [0, 2**64)."""
        a = operator.index(address)
        if not 0 <= a < _MAX_ADDRESS:
            raise ValueError(f"address {a} out of range [0, 2**64)")
        self._put_rows(_digest_rows([key]), np.array([a], dtype=np.uint64))

    def remove_digests(self, digests: np.ndarray) -> int:
        """Remove the given digests; returns how many were present (absent ones
        are ignored).  Leaves tombstones; never shrinks the table."""
        return self._remove_rows(_as_digests(digests))

    def remove_many(self, keys: Sequence[str]) -> int:
        """``remove_digests`` for str keys."""
        return self._remove_rows(_digest_rows(keys))

    def _remove_rows(self, q: np.ndarray) -> int:
        return int(_remove_kernel(self._keys, self._vals, self._shift, q, self._counts))

    def clear(self) -> None:
        """Drop every entry and return to the initial capacity."""
        self._allocate(self._initial_capacity)


_warm = False


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel now, once per process, on a
    throwaway index: a server calls it when it opens its store, so no first lookup or first
    write of a request compiles on the serving path (seen: 0.27 s of LLVM in the linker's
    offload thread during the first requests after a start)."""
    global _warm
    if _warm:
        return
    ix = KeyIndex(_MIN_CAPACITY)
    keys = [f"flatcake-warm-up-{i}" for i in range(_MIN_CAPACITY)]   # > 3/4: a rebuild
    ix.put_many(keys, np.arange(1, len(keys) + 1, dtype=np.uint64))
    ix.lookup(keys[:4])
    ix.prefix_hits(keys[:4])
    ix.items_digests()
    ix.remove_many(keys[:4])
    _warm = True

