"""Node identities for the cluster's tests: nodes 0..7 with fixed keys (``seed``), one roster
listing them all, a ``ClusterSecret`` per node (``node_secret``) and the files a node process
reads (``write_node_files``).  Node 9 is left out of the roster (``OUTSIDER``): a valid key
pair the operator never listed."""

from __future__ import annotations

import hashlib
import os

from tests.support.redis_server import TEST_SECRET

NODES = range(8)
OUTSIDER = 9


def seed(node: int) -> bytes:
    return hashlib.sha256(b"flatcake-test-node-%d" % node).digest()


def roster_text(nodes=NODES) -> str:
    from sglang_flatcake.cluster.identity import roster_line
    return "".join(roster_line(n, seed(n)) + "\n" for n in nodes)


def node_secret(node: int) -> "ClusterSecret":  # noqa: F821
    """The cluster secret with node ``node``'s identity (the roster of ``NODES``)."""
    from sglang_flatcake.cluster.identity import NodeIdentity, parse_roster
    from sglang_flatcake.cluster.secret import ClusterSecret
    roster = parse_roster(roster_text())
    if node == OUTSIDER:            # a key the roster does not list: built around the check
        roster = {**roster, OUTSIDER: parse_roster(roster_text([OUTSIDER]))[OUTSIDER]}
        ident = NodeIdentity(node, seed(node), roster)
        ident.roster = parse_roster(roster_text())
        return ClusterSecret(TEST_SECRET, ident)
    return ClusterSecret(TEST_SECRET, NodeIdentity(node, seed(node), roster))


def write_node_files(folder, node: int) -> tuple[str, str]:
    """``(key file, roster file)`` of ``node`` in ``folder`` (created private)."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    key, roster = os.path.join(folder, f"node{node}.key"), os.path.join(folder, "roster")
    with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(seed(node).hex() + "\n")
    with open(os.open(roster, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(roster_text())
    return key, roster
