"""Argument checks of the store's calls: what a caller may pass, refused with a clear error.

- ``check_label(label)``: a session label is a ``str`` of at most ``LABEL_MAX`` UTF-8
  bytes (what both media keep); ``ValueError`` / ``TypeError`` naming it otherwise.
  ``label_for(client_id)`` turns any client session id into such a label (a long or
  unencodable one becomes a digest of it), for adapters.
- ``check_unique(keys, digests)``: one batch of ``put`` names each key once
  (``ValueError`` naming the repeated key and its positions).
- ``repeated(keys)``: for ``get``, ``(distinct keys in first-seen order, position of
  each key in them)`` when a key repeats, else ``None``.  Both compare the index's
  128-bit digests, so two spellings of one key (hex in either case) count as one.
- ``check_out(out)``: ``get`` writes into ``out`` in place, so ``out`` must be a writable
  C-contiguous array (``ValueError`` otherwise: a copy would be filled, not ``out``).
- ``as_blocks(layout, blocks, n)``: ``blocks`` seen as ``(n, layers, block_layer_bytes)``
  uint8 (``ValueError`` naming both sizes when its bytes are not ``n`` blocks).
- ``check_signals(signals, n)``: one ``WriteSignals`` per key (one given is repeated);
  each of its counts an ``int`` (a ``bool`` or a float is refused, ``TypeError``).
- ``check_keys(keys, call)``: a key list is a sequence of keys, never one ``str`` (or
  ``bytes``), which would be read as one key per character (``TypeError`` naming it).
- ``check_count(n, call, name)``: a count is an ``int`` (not a ``bool``; ``TypeError``)
  >= 0 (``ValueError``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import numpy as np

from .keys import key_digests
from .placement import WriteSignals
from .tiers.region_meta import LABEL_MAX


def check_label(label) -> None:
    if not isinstance(label, str):
        raise TypeError(f"put: label must be a str, got {type(label).__name__} {label!r}")
    try:
        n = len(label.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise ValueError(f"put: label {label!r} is not valid UTF-8 ({e.reason} at {e.start})") \
            from None
    if n > LABEL_MAX:
        raise ValueError(f"put: label of {n} UTF-8 bytes ({label[:40]!r}...) exceeds "
                         f"{LABEL_MAX}; use store_checks.label_for to shorten a client id")


def label_for(client_id) -> str:
    """A label for any client session id: itself when it fits, else ``sha256:<hex>`` of it."""
    s = "" if client_id is None else str(client_id)
    try:
        if len(s.encode("utf-8")) <= LABEL_MAX:
            return s
    except UnicodeEncodeError:
        pass
    return "sha256:" + hashlib.sha256(s.encode("utf-8", "surrogatepass")).hexdigest()


def _groups(digests: np.ndarray):
    """``(first index of each distinct digest, group of each row)`` when a digest repeats,
    else ``None`` (a sort of the first 64 bits rules most batches out at once)."""
    if len(digests) < 2:
        return None
    lo = np.sort(digests[:, 0])
    if not (lo[1:] == lo[:-1]).any():
        return None
    rows = np.ascontiguousarray(digests, np.uint64).view("V16").ravel()
    _, first, inv = np.unique(rows, return_index=True, return_inverse=True)
    if len(first) == len(digests):
        return None
    return first, inv.ravel()


def check_unique(keys: Sequence[str], digests: np.ndarray) -> None:
    got = _groups(digests)
    if got is None:
        return
    first, inv = got
    g = int(np.argmax(np.bincount(inv) > 1))
    pos = np.nonzero(inv == g)[0].tolist()
    raise ValueError(f"put: key {keys[int(first[g])]!r} appears {len(pos)} times in one "
                     f"batch (positions {pos}); a chain names each block once")


def repeated(keys: Sequence[str]) -> tuple[list[str], np.ndarray] | None:
    got = _groups(key_digests(keys)) if len(keys) > 1 else None
    if got is None:
        return None
    first, inv = got
    order = np.argsort(first)                    # distinct keys in first-seen order
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return [keys[int(i)] for i in first[order]], rank[inv].astype(np.int64)


def check_out(out) -> np.ndarray:
    b = np.asarray(out)
    if not b.flags.c_contiguous:
        raise ValueError(f"get: out must be C-contiguous (shape {b.shape}, strides {b.strides}); "
                         "its bytes are filled in place. Use alloc_blocks(n) or "
                         "np.ascontiguousarray")
    if not b.flags.writeable:
        raise ValueError("get: out is read-only")
    return b


def as_blocks(layout, blocks, n: int) -> np.ndarray:
    b = np.asarray(blocks)
    if b.dtype != np.uint8:
        b = b.view(np.uint8) if b.flags.c_contiguous else np.ascontiguousarray(b).view(np.uint8)
    want = n * layout.block_bytes
    if b.nbytes != want:
        raise ValueError(f"blocks hold {b.nbytes} bytes; {n} blocks of this layout need {want}")
    return b.reshape(n, layout.layers, layout.block_layer_bytes)


def check_signals(signals, n: int) -> list[WriteSignals]:
    if signals is None:
        signals = WriteSignals()
    sigs = [signals] * n if isinstance(signals, WriteSignals) else list(signals)
    if len(sigs) != n:
        raise ValueError(f"put: {len(sigs)} signals for {n} keys")
    for sg in {id(sg): sg for sg in sigs}.values():     # each distinct object once
        if not isinstance(sg, WriteSignals):
            raise TypeError(f"put: signals must be WriteSignals, got {type(sg).__name__} {sg!r}")
        for f in dataclasses.fields(sg):
            v = getattr(sg, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"put: WriteSignals.{f.name} must be an int, got "
                                f"{type(v).__name__} {v!r}")
    return sigs


def check_keys(keys, call: str, name: str = "keys") -> None:
    if isinstance(keys, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"{call}: {name} must be a list of keys, got one {type(keys).__name__} "
                        f"{keys[:70]!r}; pass [key] for one key")


def check_count(n, call: str, name: str) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"{call}: {name} must be an int, got {type(n).__name__} {n!r}")
    if n < 0:
        raise ValueError(f"{call}: {name} must be >= 0, got {n}")
    return int(n)
