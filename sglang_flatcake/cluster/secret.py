"""The cluster secret: every node of a cluster reads the same secret file
(``--flatcake-cluster-secret-file``), and everything one node tells another is authenticated
with it -- owner messages and grants (``wire``), directory entries and leases
(``redis_directory``), and the per-block records a writing node makes at publish time
(``records``).  Tenant tags are keyed with it, so a tag reveals nothing about its salt;
a tenant's key (``tenant_key``) never leaves a node.  Node keys (``node_key``, HKDF) are
derived from it: they prove a message's sender against anyone without the secret, not
against another member (docs/cluster-security.md).

The MAC is keyed BLAKE2b (``hashlib``, RFC 7693 keyed mode, 16-byte tags), one derived key
per purpose (``person``), every part length-prefixed.  The secret never appears in
``repr``, logs or messages.  The file is read by ``secret_file.read_secret_file``.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from ..errors import ConfigError
from .secret_file import MIN_SECRET_BYTES, read_secret_file

MAC_BYTES = 16


class ClusterSecret:
    """A cluster's shared secret (at least ``MIN_SECRET_BYTES``).  ``mac`` tags bytes for
    one ``purpose``; ``check`` compares in constant time; ``node_mac``/``node_check`` do so
    under a node's key; ``tag`` is a tenant's keyed key-space prefix."""

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(f"the cluster secret has {len(secret or b'')} bytes: expected at "
                              f"least {MIN_SECRET_BYTES} (e.g. `head -c 32 /dev/urandom > FILE`)")
        self._key = hashlib.blake2b(bytes(secret), digest_size=64,
                                    person=b"flatcake-cluster").digest()
        self._node_keys: dict[str, bytes] = {}     # node_key's, cached (bounded)

    @classmethod
    def from_file(cls, path: str) -> "ClusterSecret":
        """Read the secret from ``path`` (``secret_file.read_secret_file``: a private
        regular file of this user in a private directory, at least 32 bytes of varied
        content).  ``ConfigError`` names the path (never the contents) when it is not."""
        return cls(read_secret_file(path))

    def mac(self, purpose: bytes, *parts: bytes | str | int) -> bytes:
        """A 16-byte keyed BLAKE2b of ``parts`` (each length-prefixed) for ``purpose``
        (at most 16 bytes: the hash's personalisation, so tags never cross purposes)."""
        h = hashlib.blake2b(key=self._key, digest_size=MAC_BYTES, person=purpose)
        for p in parts:
            b = p.encode() if isinstance(p, str) else (str(p).encode() if isinstance(p, int)
                                                       else bytes(p))
            h.update(struct.pack("<Q", len(b)))
            h.update(b)
        return h.digest()

    def check(self, tag: bytes | str, purpose: bytes, *parts) -> bool:
        """Does ``tag`` (bytes, or hex) authenticate ``parts`` for ``purpose``?"""
        if isinstance(tag, str):
            try:
                tag = bytes.fromhex(tag)
            except ValueError:
                return False
        return hmac.compare_digest(tag, self.mac(purpose, *parts))

    def node_key(self, node: str) -> bytes:
        """Node ``node``'s 32-byte key: HKDF-SHA256 of the cluster secret with the node's
        name as info (cached, at most 4096 names).  Any holder of the cluster secret can
        derive it (not a per-node secret: docs/cluster-security.md)."""
        key = self._node_keys.get(node)
        if key is None:
            from cryptography.hazmat.primitives import hashes
            from cryptography.hazmat.primitives.kdf.hkdf import HKDF
            if len(self._node_keys) >= 4096:
                self._node_keys.clear()
            key = self._node_keys[node] = HKDF(hashes.SHA256(), 32, b"flatcake-node",
                                               b"node|" + node.encode()).derive(self._key)
        return key

    def node_mac(self, node: str, purpose: bytes, *parts) -> bytes:
        """``mac`` under node ``node``'s key instead of the cluster's: what proves a
        message's sender (any holder of the cluster secret can still make one)."""
        h = hashlib.blake2b(key=self.node_key(node), digest_size=MAC_BYTES, person=purpose)
        for p in parts:
            b = bytes(p)
            h.update(struct.pack("<Q", len(b)))
            h.update(b)
        return h.digest()

    def node_check(self, tag: bytes, node: str, purpose: bytes, *parts) -> bool:
        """Does ``tag`` authenticate ``parts`` under node ``node``'s key?"""
        return hmac.compare_digest(tag, self.node_mac(node, purpose, *parts))

    def tenant_key(self, tenant: str) -> bytes:
        """The tenant's (``cache_salt``'s) key: what a fetch proves it knows
        (``wire.tenant_proof``).  Unlike the tag it never leaves a node: a party that read a
        tag in Redis cannot fetch that tenant's blocks without the salt."""
        if not isinstance(tenant, str):
            raise ConfigError(f"tenant={tenant!r} is not a string (cache_salt)")
        return self.mac(b"tenant-key", tenant)

    def tag(self, tenant: str) -> str:
        """The tenant's (``cache_salt``'s) key-space prefix: keyed, so nobody without the
        secret can link a tag to its salt or guess one."""
        if not isinstance(tenant, str):
            raise ConfigError(f"tenant={tenant!r} is not a string (cache_salt)")
        return self.mac(b"tenant", tenant).hex()

    def __repr__(self) -> str:
        return "ClusterSecret(<hidden>)"
