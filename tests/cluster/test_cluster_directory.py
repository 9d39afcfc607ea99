"""The directory contract, against a real redis-server (tests/support/redis_server.py)."""

from __future__ import annotations

import threading

import pytest

from sglang_flatcake.cluster.directory import DirectoryError
from sglang_flatcake.cluster.redis_directory import RedisDirectory
from sglang_flatcake.errors import ConfigError

from tests.support import chain, extend
from tests.support.cluster_keys import node_secret

SECRET = node_secret(0)


@pytest.fixture
def make(redis_url):  # noqa: F811
    made = []

    def _make(node=None, endpoint=None, **kw):
        d = RedisDirectory(redis_url, SECRET if node is None else node_secret(node), **kw)
        made.append(d)
        if node is not None:
            d.join(node, endpoint or f"tcp://127.0.0.1:{7000 + node}")
        return d

    yield _make
    for d in made:
        d.close()


def test_publish_then_lookup_names_owner_and_endpoint(make):
    a, b = make(1), make(2)
    keys = chain(10)
    a.publish("", "s1", keys[:6])
    b.publish("", "s2", keys[6:8])
    got = make().lookup("", keys)
    assert got.hits == 8
    assert got.owners == (1,) * 6 + (2,) * 2
    assert got.endpoints == {1: "tcp://127.0.0.1:7001", 2: "tcp://127.0.0.1:7002"}
    assert got.runs() == [(1, 0, 6), (2, 6, 2)]
    assert make().lookup("", chain(3, "other")).hits == 0


def test_leading_run_stops_at_first_missing_page(make):
    a = make(1)
    keys = chain(6)
    a.publish("", "s", keys[:2] + keys[3:])
    assert a.lookup("", keys).hits == 2


def test_lookup_is_one_round_trip(make, monkeypatch):
    a = make(3)
    keys = chain(200)
    a.publish("", "s", keys)
    a.lookup("", keys[:1])                      # the first call on a server loads the script
    calls = []
    orig = a._r.execute_command
    monkeypatch.setattr(a._r, "execute_command",
                        lambda *args, **kw: calls.append(args[0]) or orig(*args, **kw))
    assert a.lookup("", keys).hits == 200
    assert calls == ["EVALSHA"]


def test_tenants_apart(make):
    a = make(1)
    keys = chain(5)
    a.publish("tenant-a", "s", keys)
    r = make()
    assert r.lookup("tenant-a", keys).hits == 5
    assert r.lookup("tenant-b", keys).hits == 0
    assert r.lookup("", keys).hits == 0
    a.remove_session("tenant-b", "s")          # another tenant's removal touches nothing
    assert r.lookup("tenant-a", keys).hits == 5


def test_remove_session_drops_only_its_own_entries(make):
    a, b = make(1), make(2)
    keys = chain(8)
    a.publish("", "s", keys)
    b.publish("", "t", keys[4:])                # node 2 now holds the tail too (last writer)
    assert a.remove_session("", "s") == 4       # the head only: the tail names node 2
    got = make().lookup("", keys)
    assert got.hits == 0
    assert make().lookup("", keys[4:]).owners == (2,) * 4
    assert a.remove_session("", "unknown") == 0


def test_leave_drops_entries(make):
    a = make(1)
    keys = chain(4)
    a.publish("", "s", keys)
    a.leave()
    assert make().lookup("", keys).hits == 0
    with pytest.raises(DirectoryError, match="before join"):
        a.publish("", "s", keys)


def test_dead_node_loses_entries_when_lease_lapses(make):
    a = make(1, lease_ms=200)
    keys = chain(4)
    a.publish("", "s", keys)
    r = make()
    assert r.lookup("", keys).hits == 4
    a._stop_beat()                              # the node dies: no more heartbeats
    r._r.pexpire(a._lease_key(1), 1)            # and its lease runs out
    gone = threading.Event()
    while not gone.wait(0.01):
        if r._r.get(a._lease_key(1)) is None:
            gone.set()
    assert r.lookup("", keys).hits == 0


def test_heartbeat_keeps_lease_past_its_ttl(make):
    a = make(1, lease_ms=150)
    keys = chain(3)
    a.publish("", "s", keys)
    r = make()
    for _ in range(3):                          # three lease lifetimes
        threading.Event().wait(0.15)
        assert r.lookup("", keys).hits == 3


def test_restarted_node_old_entries_are_misses(make):
    a = make(5)
    keys = chain(4)
    a.publish("", "s", keys)
    a._stop_beat()
    a.node = None                               # crashed: it never left
    again = make(5)                             # same node id, new incarnation
    assert make().lookup("", keys).hits == 0
    again.publish("", "s2", keys[:2])
    assert make().lookup("", keys).hits == 2


def test_bad_arguments_are_named(make, redis_url):  # noqa: F811
    d = make()
    with pytest.raises(ConfigError, match="node=4096"):
        d.join(4096, "tcp://x:1")
    with pytest.raises(ConfigError, match="endpoint="):
        d.join(1, "a|b")
    with pytest.raises(ConfigError, match="lease_ms=1"):
        RedisDirectory(redis_url, SECRET, lease_ms=1)
    with pytest.raises(ConfigError, match="tenant="):
        d.lookup(None, ["k"])


def test_unreachable_directory_is_an_error_within_bound():
    pytest.importorskip("redis", reason="PyPI redis client missing (pip install redis)")
    from tests.support import free_port
    d = RedisDirectory(f"redis://127.0.0.1:{free_port()}/0", SECRET, timeout_s=0.2)
    with pytest.raises(DirectoryError, match="lookup failed"):
        d.lookup("", chain(2))
    d.close()


def test_branch_keys_resolve_to_their_own_owner(make):
    a, b = make(1), make(2)
    base = chain(4)
    br = extend(base, 3, "branch")
    a.publish("", "s", base)
    b.publish("", "t", br)
    assert make().lookup("", base + br).owners == (1,) * 4 + (2,) * 3
