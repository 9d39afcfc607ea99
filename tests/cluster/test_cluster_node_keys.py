"""Per-node identity's files (``cluster/identity.py``, ``cluster/keygen.py``): a node's key
file is checked like the secret file, the roster may be read but not written by others, a
key that is not the roster's for its node id or a malformed roster line stops the node, and
``keygen`` makes a private key file whose printed line the roster accepts."""

from __future__ import annotations

import os
import subprocess
import sys
import time

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


def test_a_node_deleted_from_the_roster_is_refused_without_a_restart(tmp_path, caplog):
    """The operator deletes node 2's line: node 0 trusts the new roster at its next check
    (its signatures, its MACs and its messages refused); a roster that drops node 0 itself,
    or does not parse, is refused and the last good one kept."""
    from sglang_flatcake.cluster import wire
    from sglang_flatcake.cluster.roster_watch import RosterWatch
    from sglang_flatcake.cluster.secret import ClusterSecret
    from tests.support.cluster_keys import node_secret
    from tests.support.redis_server import TEST_SECRET
    key, roster = write_node_files(str(tmp_path / "keys"), 0)
    me = NodeIdentity.from_files(0, key, roster)
    two = node_secret(2)
    signed = wire.seal(two, {"op": "fetch"})
    paired = wire.seal_to(two, {"op": "fetch"}, 0)
    mine = ClusterSecret(TEST_SECRET, me)
    assert wire.unseal_from(mine, signed)[0] == 2 and wire.unseal_from(mine, paired)[0] == 2
    watch = RosterWatch(me, roster, every_s=3600)        # polled by hand here
    try:
        assert not watch.check()                          # unchanged

        def rewrite(text):
            with open(roster, "w") as f:
                f.write(text)
            os.utime(roster, ns=(time.time_ns(), time.time_ns() + 10**9))
        rewrite(roster_text([0, 1, 3]))
        assert watch.check() and sorted(me.roster) == [0, 1, 3]
        assert me.pair_key(2) is None and not me.verify(2, b"\0" * 64, b"msg")
        for raw in (signed, paired):
            with pytest.raises(wire.WireError, match="not authenticated"):
                wire.unseal_from(mine, raw)
        for bad in (roster_text([1, 2, 3]), "0 nothex\n"):  # drops node 0; does not parse
            rewrite(bad)
            assert not watch.check() and sorted(me.roster) == [0, 1, 3]
        assert watch.counts == {"roster_reloads": 1, "roster_refused": 2}
        assert "the changed roster is refused, the last one kept" in caplog.text
    finally:
        watch.close()


def test_the_watch_thread_reads_a_changed_roster(tmp_path):
    from sglang_flatcake.cluster.roster_watch import RosterWatch
    key, roster = write_node_files(str(tmp_path / "keys"), 0)
    me = NodeIdentity.from_files(0, key, roster)
    watch = RosterWatch(me, roster, every_s=0.05)
    try:
        with open(roster, "w") as f:
            f.write(roster_text([0, 5]))
        os.utime(roster, ns=(time.time_ns(), time.time_ns() + 10**9))
        end = time.monotonic() + 5
        while sorted(me.roster) != [0, 5] and time.monotonic() < end:
            time.sleep(0.02)
        assert sorted(me.roster) == [0, 5]
    finally:
        watch.close()
