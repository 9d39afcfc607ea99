"""Per-node identity's files (``cluster/identity.py``, ``cluster/keygen.py``): a node's key
file is checked like the secret file, the roster may be read but not written by others, a
key that is not the roster's for its node id or a malformed roster line stops the node, and
``keygen`` makes a private key file whose printed line the roster accepts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sglang_flatcake.cluster.identity import NodeIdentity, parse_roster, roster_line
from sglang_flatcake.errors import ConfigError

from tests.support.cluster_keys import roster_text, seed, write_node_files


def test_the_roster_may_be_read_but_not_written_by_others(tmp_path):
    key, roster = write_node_files(tmp_path / "keys", 2)
    os.chmod(roster, 0o644)
    assert NodeIdentity.from_files(2, key, roster).node == 2
    os.chmod(roster, 0o664)
    with pytest.raises(ConfigError, match="cluster_roster_file=.* is writable by group or others"):
        NodeIdentity.from_files(2, key, roster)
    os.chmod(roster, 0o600)
    os.chmod(key, 0o644)                       # the key file: the secret file's checks
    with pytest.raises(ConfigError, match="cluster_node_key_file=.* is readable by group"):
        NodeIdentity.from_files(2, key, roster)


def test_a_key_that_is_not_the_rosters_for_its_node_stops_the_node(tmp_path):
    key, roster = write_node_files(tmp_path / "keys", 2)
    with pytest.raises(ConfigError, match="node 3's key is not the one the roster lists"):
        NodeIdentity.from_files(3, key, roster)           # node 2's key, started as node 3
    with open(roster, "w") as f:
        f.write(roster_text([0, 1]))                      # node 2 not listed
    with pytest.raises(ConfigError, match="node 2's key is not the one the roster lists"):
        NodeIdentity.from_files(2, key, roster)


@pytest.mark.parametrize("line", ["x abc def", "1 " + "00" * 32, "5000 " + "00" * 64,
                                  roster_line(1, seed(1)) + "\n" + roster_line(1, seed(2))])
def test_a_malformed_roster_is_refused_naming_the_line(line):
    with pytest.raises(ConfigError, match="roster line [12] is not"):
        parse_roster(line)


def test_a_cluster_node_needs_its_key_and_the_roster(tmp_path):
    from sglang_flatcake.cluster.node import ClusterNode
    from sglang_flatcake.config import FlatCakeConfig
    from sglang_flatcake.layout import KVLayout
    from sglang_flatcake.store import FlatCakeStore
    cfg = FlatCakeConfig(cluster_directory="redis://127.0.0.1:6379/0", durable=False,
                         cluster_secret_file=str(tmp_path / "s"))
    with FlatCakeStore(tmp_path / "st", KVLayout.mha(2, 2, 32, "bfloat16", 16), cfg) as st:
        with pytest.raises(ConfigError, match="cluster_node_key_file and cluster_roster_file"):
            ClusterNode(st, cfg)


def test_keygen_makes_a_private_key_whose_line_the_roster_accepts(tmp_path):
    out = tmp_path / "keys" / "node.key"
    out.parent.mkdir(mode=0o700)
    cmd = [sys.executable, "-m", "sglang_flatcake.cluster.keygen", "--node", "5", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert oct(os.stat(out).st_mode & 0o777) == "0o600"
    roster = tmp_path / "keys" / "roster"
    roster.write_text(r.stdout)
    os.chmod(roster, 0o600)
    assert NodeIdentity.from_files(5, str(out), str(roster)).node == 5
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "never overwritten" in again.stderr
