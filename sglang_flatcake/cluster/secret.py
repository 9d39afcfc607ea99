"""The cluster secret: every node of a cluster reads the same secret file
(``--flatcake-cluster-secret-file``), and everything one node tells another is authenticated
with it -- owner messages and grants (``wire``), directory entries and leases
(``redis_directory``), and the per-block records a writing node makes at publish time
(``records``).  Tenant tags are keyed with it, so a tag reveals nothing about its salt;
a tenant's key (``tenant_key``) never leaves a node.  What proves *which* node speaks is not
the shared secret but the node's own keys (``identity``: Ed25519 and X25519 per node, public
keys in the operator's roster), carried here as ``identity`` (docs/cluster-security.md).

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
    one ``purpose``; ``check`` compares in constant time; ``tag`` is a tenant's keyed
    key-space prefix.  ``identity`` is this node's (``NodeIdentity``), when it has one."""

    def __init__(self, secret: bytes, identity=None) -> None:
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(f"the cluster secret has {len(secret or b'')} bytes: expected at "
                              f"least {MIN_SECRET_BYTES} (e.g. `head -c 32 /dev/urandom > FILE`)")
        self._key = hashlib.blake2b(bytes(secret), digest_size=64,
                                    person=b"flatcake-cluster").digest()
        self._identity = identity

    @classmethod
    def from_file(cls, path: str) -> "ClusterSecret":
        """Read the secret from ``path`` (``secret_file.read_secret_file``: a private
        regular file of this user in a private directory, at least 32 bytes of varied
        content).  ``ConfigError`` names the path (never the contents) when it is not."""
        return cls(read_secret_file(path))

    @classmethod
    def for_node(cls, path: str, node: int, key_file: str, roster_file: str) -> "ClusterSecret":
        """``from_file`` with node ``node``'s identity (``NodeIdentity.from_files``)."""
        from .identity import NodeIdentity
        return cls(read_secret_file(path), NodeIdentity.from_files(node, key_file, roster_file))

    @property
    def identity(self):
        """This node's ``NodeIdentity``; ``ConfigError`` when it was given none."""
        if self._identity is None:
            raise ConfigError("this cluster secret has no node identity: a node needs its key "
                              "file and the roster (--flatcake-cluster-node-key-file, "
                              "--flatcake-cluster-roster-file; docs/cluster.md)")
        return self._identity

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
