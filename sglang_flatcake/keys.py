"""Block keys as 128-bit fingerprints, what the index and every segment header store.

For a 64-char hex key (an SGLang page hash) the fingerprint is the first 16 bytes of
``bytes.fromhex(key)`` -- hex is case-insensitive, so ``"AB.."`` and ``"ab.."`` are one
key; any other ``str`` uses ``blake2b(key.encode(), digest_size=16)`` (lone surrogates
are encoded with ``surrogatepass`` rather than failing).  Two keys with equal
fingerprints are one key (probability ~2**-128 per pair).  A non-``str`` key raises
``TypeError``.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np


def key_digest(key: str) -> bytes:
    """The 16-byte fingerprint of one key (see the module docstring)."""
    if not isinstance(key, str):
        raise TypeError(f"key must be str, not {type(key).__name__}")
    if len(key) == 64:
        try:
            raw = bytes.fromhex(key)
        except ValueError:
            raw = b""
        if len(raw) == 32:  # whitespace would shorten it
            return raw[:16]
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def key_digests(keys: Sequence[str]) -> np.ndarray:
    """Fingerprints of ``keys`` as a C-contiguous (n, 2) uint64 array.

    Row i equals ``np.frombuffer(key_digest(keys[i]), '<u8')``.  All-hex batches
    take one ``join`` + ``fromhex``; anything else falls back to per-key work.
    One ``str`` (or ``bytes``) instead of a list raises ``TypeError`` naming it.
    """
    if isinstance(keys, (str, bytes)):      # else each character would be taken as a key
        raise TypeError(f"keys={keys[:80]!r} is not allowed: expected a list of keys, "
                        f"not one {type(keys).__name__}")
    rows = _digest_rows(keys)
    return rows if rows.shape[1] == 2 else np.ascontiguousarray(rows[:, :2])


def _digest_rows(keys: Sequence[str]) -> np.ndarray:
    """C-contiguous (n, 2) or (n, 4) uint64 array whose first two columns are
    the fingerprints (the kernels read only those); saves a strided copy."""
    n = len(keys)
    if n == 0:
        return np.empty((0, 2), dtype=np.uint64)
    try:
        raw = bytes.fromhex("".join(keys)) if set(map(len, keys)) == {64} else b""
    except (ValueError, TypeError):       # not all 64-char hex strs: each key on its own
        raw = b""
    if len(raw) == 32 * n:                # whitespace would shorten it
        return np.frombuffer(raw, "<u8").reshape(n, 4).copy()
    raw = b"".join([key_digest(k) for k in keys])
    return np.frombuffer(raw, "<u8").reshape(n, 2).copy()
