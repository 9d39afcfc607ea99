"""Block keys as 128-bit fingerprints, what the index and every segment header store.

For a 64-char hex key (an SGLang page hash) the fingerprint folds all 32 bytes of
``bytes.fromhex(key)``, read as little-endian uint64 words ``w0..w3``, into two:
``d0 = w0 ^ (w2 * FOLD[0])``, ``d1 = w1 ^ (w3 * FOLD[1])`` (mod 2**64; both multipliers odd,
so keys that differ in one word never alias, and swapped halves do not either).  Hex is
case-insensitive, so ``"AB.."`` and ``"ab.."`` are one key.  Any other ``str`` uses
``blake2b(key.encode(), digest_size=16)`` (lone surrogates are encoded with
``surrogatepass`` rather than failing).  Two keys with equal fingerprints are one key
(probability ~2**-128 per pair).  A non-``str`` key raises ``TypeError``.  The scheme is
part of the on-disk format (``FORMAT_VERSION``); ``tests/store/test_index.py`` pins it with
golden vectors.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

import numpy as np

FOLD = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)     # odd: multiplying is a bijection
_MASK = (1 << 64) - 1
_FOLD_NP = np.array(FOLD, dtype=np.uint64)


def _fold(raw: bytes) -> bytes:
    w0, w1, w2, w3 = struct.unpack("<4Q", raw)
    return struct.pack("<2Q", w0 ^ ((w2 * FOLD[0]) & _MASK), w1 ^ ((w3 * FOLD[1]) & _MASK))


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
            return _fold(raw)
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
    return _digest_rows(keys)


def _digest_rows(keys: Sequence[str]) -> np.ndarray:
    """The fingerprints as a C-contiguous (n, 2) uint64 array: an all-hex batch folded in
    one vectorized step, anything else key by key."""
    n = len(keys)
    if n == 0:
        return np.empty((0, 2), dtype=np.uint64)
    try:
        raw = bytes.fromhex("".join(keys)) if set(map(len, keys)) == {64} else b""
    except (ValueError, TypeError):       # not all 64-char hex strs: each key on its own
        raw = b""
    if len(raw) == 32 * n:                # whitespace would shorten it
        w = np.frombuffer(raw, "<u8").reshape(n, 4)
        return np.ascontiguousarray(w[:, :2] ^ (w[:, 2:] * _FOLD_NP))
    raw = b"".join([key_digest(k) for k in keys])
    return np.frombuffer(raw, "<u8").reshape(n, 2).copy()
