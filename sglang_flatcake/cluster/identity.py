"""Per-node identity: each node holds its own private key and every node the operator's
roster of public keys, so one member cannot speak, sign or open grants as another.

- **Node key file** (``--flatcake-cluster-node-key-file``, made by ``cluster.keygen``): 32
  random bytes in hex, read with the secret file's checks (``secret_file``).  Two keys are
  derived from it (HKDF-SHA256): an Ed25519 signing key and an X25519 key.
- **Roster file** (``--flatcake-cluster-roster-file``): ``<node id> <ed25519 public hex>
  <x25519 public hex>`` per line (``#`` comments), written by the operator from ``keygen``'s
  output, read with the same checks except that others may read it (no one but its owner
  may write it or its directory).  It is the root of trust: a Redis writer or another member
  cannot add a node to it.

The roster is read again when its file changes (``RosterWatch``, a node's thread): a line
deleted there is refused from then on (its signatures, its MACs, its grants), with no
restart; a roster that no longer lists this node with its key, or does not parse, is
refused and the one before kept (logged).

``sign``/``verify`` (Ed25519) are for what third parties check: directory entries and
leases.  ``pair_key`` is the X25519 shared secret of this node and a peer (HKDF'd, cached):
what MACs messages between the two and derives their grant keys, so no third node can.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import NamedTuple

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..errors import ConfigError
from .secret_file import read_secret_file

MAX_NODE = 4095
SIG_BYTES = 64
MAX_ROSTER_BYTES = 1 << 20


class PublicKeys(NamedTuple):
    sign: Ed25519PublicKey
    dh: X25519PublicKey


def _derive(seed: bytes, what: bytes) -> bytes:
    return HKDF(hashes.SHA256(), 32, b"flatcake-node-key", what).derive(seed)


def private_keys(seed: bytes) -> tuple[Ed25519PrivateKey, X25519PrivateKey]:
    """The signing and key-exchange keys a node key file's 32-byte ``seed`` stands for."""
    return (Ed25519PrivateKey.from_private_bytes(_derive(seed, b"ed25519")),
            X25519PrivateKey.from_private_bytes(_derive(seed, b"x25519")))


def roster_line(node: int, seed: bytes) -> str:
    """The roster line of ``node`` whose key file holds ``seed``."""
    s, d = private_keys(seed)
    return _line(node, PublicKeys(s.public_key(), d.public_key()))


def parse_roster(text: str, where: str = "roster") -> dict[int, PublicKeys]:
    """``{node: PublicKeys}`` of a roster's text; ``ConfigError`` naming the line when one is
    not ``<node 0..4095> <64 hex> <64 hex>`` or repeats a node."""
    out: dict[int, PublicKeys] = {}
    for no, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        try:
            node = int(parts[0]) if parts[0].isdigit() else -1
            if len(parts) != 3 or not 0 <= node <= MAX_NODE or node in out:
                raise ValueError
            out[node] = PublicKeys(Ed25519PublicKey.from_public_bytes(bytes.fromhex(parts[1])),
                                   X25519PublicKey.from_public_bytes(bytes.fromhex(parts[2])))
        except ValueError:
            raise ConfigError(f"{where} line {no} is not '<node 0..{MAX_NODE}> <ed25519 public "
                              f"hex> <x25519 public hex>' (or repeats a node)") from None
    return out


def _lp(purpose: bytes, parts) -> bytes:
    out = [struct.pack("<Q", len(purpose)), purpose]
    for p in parts:
        b = p.encode() if isinstance(p, str) else (str(p).encode() if isinstance(p, int)
                                                   else bytes(p))
        out += [struct.pack("<Q", len(b)), b]
    return b"".join(out)


def _line(node: int, k: PublicKeys) -> str:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
    raw = (Encoding.Raw, PublicFormat.Raw)
    return f"{node} {k.sign.public_bytes(*raw).hex()} {k.dh.public_bytes(*raw).hex()}"


def read_roster(roster_file: str) -> dict[int, PublicKeys]:
    """The roster file's ``{node: PublicKeys}``, read with the secret file's checks (others
    may read it); ``ConfigError`` naming the file or the line."""
    text = read_secret_file(roster_file, "cluster_roster_file", most=MAX_ROSTER_BYTES,
                            public=True).decode("ascii", "replace")
    return parse_roster(text, f"cluster_roster_file={roster_file!r}")


class NodeIdentity:
    """Node ``node``'s private keys (from its key file's ``seed``) and the ``roster``.
    Refused (``ConfigError``) when the roster does not list ``node`` with these keys."""

    def __init__(self, node: int, seed: bytes, roster: dict[int, PublicKeys]) -> None:
        if len(seed) != 32:
            raise ConfigError(f"a node key holds {len(seed)} bytes: expected 32 (cluster.keygen)")
        self.node = node
        self._sign, self._dh = private_keys(seed)
        self._own = roster_line(node, seed)
        self._check(roster)
        self.roster = roster
        self._pairs: dict[int, bytes] = {}

    def _check(self, roster: dict[int, PublicKeys]) -> None:
        if self.node not in roster or self._own != _line(self.node, roster[self.node]):
            raise ConfigError(f"node {self.node}'s key is not the one the roster lists for node "
                              f"{self.node}: add `python -m sglang_flatcake.cluster.keygen` "
                              f"output for this key to the roster")

    def replace_roster(self, roster: dict[int, PublicKeys]) -> None:
        """Trust ``roster`` from now on (``ConfigError``, and the old one kept, when it does
        not list this node with its key); pair keys are derived again from it."""
        self._check(roster)
        self.roster, self._pairs = roster, {}      # each one assignment: readers see either

    @classmethod
    def from_files(cls, node: int, key_file: str, roster_file: str) -> "NodeIdentity":
        """Read the node key file (the secret file's checks) and the roster file (the same,
        but others may read it)."""
        raw = read_secret_file(key_file, "cluster_node_key_file")
        try:
            seed = bytes.fromhex(raw.decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            raise ConfigError(f"cluster_node_key_file={key_file!r} is not hex (make it with "
                              f"`python -m sglang_flatcake.cluster.keygen`)") from None
        return cls(node, seed, read_roster(roster_file))

    def sign(self, purpose: bytes, *parts) -> bytes:
        """This node's Ed25519 signature of ``parts`` (each length-prefixed) for ``purpose``."""
        return self._sign.sign(_lp(purpose, parts))

    def verify(self, node: int, sig: bytes, purpose: bytes, *parts) -> bool:
        """Is ``sig`` node ``node``'s signature (per the roster) of ``parts`` for ``purpose``?
        False for a node the roster does not list."""
        keys = self.roster.get(node)
        if keys is None or len(sig) != SIG_BYTES:
            return False
        try:
            keys.sign.verify(bytes(sig), _lp(purpose, parts))
        except InvalidSignature:
            return False
        return True

    def pair_key(self, peer: int) -> bytes | None:
        """The 32-byte key only this node and ``peer`` can compute (X25519, then HKDF over
        both ids); None for a node the roster does not list."""
        key = self._pairs.get(peer)
        if key is None:
            keys = self.roster.get(peer)
            if keys is None:
                return None
            lo, hi = sorted((self.node, peer))
            key = HKDF(hashes.SHA256(), 32, b"flatcake-pair", f"pair|{lo}|{hi}".encode()
                       ).derive(self._dh.exchange(keys.dh))
            self._pairs[peer] = key
        return key

    def pair_mac(self, peer: int, purpose: bytes, body: bytes) -> bytes | None:
        """A 16-byte keyed BLAKE2b of ``body`` under ``pair_key(peer)``; None for an unknown
        peer."""
        key = self.pair_key(peer)
        if key is None:
            return None
        return hashlib.blake2b(body, key=key, digest_size=16, person=purpose).digest()

    def pair_check(self, peer: int, tag: bytes, purpose: bytes, body: bytes) -> bool:
        mac = self.pair_mac(peer, purpose, body)
        return mac is not None and hmac.compare_digest(tag, mac)

    def __repr__(self) -> str:
        return f"NodeIdentity(node={self.node}, <private keys hidden>)"
