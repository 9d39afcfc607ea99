"""Sealed grants: what an owner stages for a requester is encrypted and authenticated with
AES-256-GCM (pyca ``cryptography``), so whatever the Transfer Engine serves to anyone who
reaches its ports is ciphertext, and a requester checks every block with a key rather than an
unkeyed checksum.

The key is fresh per grant: HKDF-SHA256 over the requester's and the owner's node keys
(``node_key``: each derived by HKDF from the cluster secret and the node's name) with the
fetch request's nonce as salt.  Only the two nodes of the grant compute it -- and, since node
keys come from the cluster secret, any other member (docs/cluster-security.md says what a
member can still do).  Each block is its own AEAD message: ciphertext then its 16-byte tag
(``sealed_bytes`` apart in a slot), nonce = its index in the grant, associated data = its
tenant tag and page key, so a block moved, swapped or replayed into another grant fails.
"""

from __future__ import annotations

import struct

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .secret import ClusterSecret

SEAL_TAG = 16                   # AES-GCM tag bytes after each block's ciphertext


def sealed_bytes(block_bytes: int) -> int:
    """Bytes one sealed block takes in a staging slot or a landing buffer."""
    return block_bytes + SEAL_TAG


def _lp(*parts: str) -> bytes:
    out = b""
    for p in parts:
        b = p.encode()
        out += struct.pack("<I", len(b)) + b
    return out


def grant_cipher(secret: ClusterSecret, requester: str, owner: str, nonce: str) -> AESGCM:
    """The AEAD of one grant: its key derived from both nodes' keys and the request's nonce."""
    ikm = secret.node_key(requester) + secret.node_key(owner)
    key = HKDF(hashes.SHA256(), 32, nonce.encode(), b"flatcake grant" + _lp(requester, owner)
               ).derive(ikm)
    return AESGCM(key)


def _nonce(i: int) -> bytes:
    return i.to_bytes(12, "little")


def _aad(tag: str, key: str) -> bytes:
    return _lp(tag, key)


def seal_block(aead: AESGCM, i: int, tag: str, key: str, plain: np.ndarray,
               out: np.ndarray) -> None:
    """Encrypt block ``i`` of a grant (``plain``, any C-contiguous shape of ``block_bytes``)
    into ``out`` (``sealed_bytes`` uint8)."""
    aead.encrypt_into(_nonce(i), memoryview(plain).cast("B"), _aad(tag, key), memoryview(out))


def open_block(aead: AESGCM, i: int, tag: str, key: str, sealed: np.ndarray,
               out: np.ndarray) -> bool:
    """Decrypt block ``i`` of a grant from ``sealed`` into ``out``; False (``out`` holds
    nothing usable) when it does not authenticate under the grant's key."""
    try:
        aead.decrypt_into(_nonce(i), memoryview(sealed), _aad(tag, key),
                          memoryview(out).cast("B"))
    except InvalidTag:
        return False
    return True
