"""The cluster, attacked as the security review did (issue 20), on loopback against a real
owner (a real FlatCakeStore on real files, a real Transfer Engine, a real redis-server):
raw Transfer Engine reads and writes of registered memory, forged directory entries and
leases, a lying owner, malformed and oversized messages, lease and grant theft, stalled
peers, and a node id taken over.  Each is a refusal or a miss, never served or accepted."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed")
zmq = pytest.importorskip("zmq", reason="pyzmq not installed")

from tests.support.cluster_owner import (OwnerProcess, attacker, empty, expected,  # noqa: E402,F401
                                         send_raw, served)
from tests.support.cluster_keys import OUTSIDER, node_secret  # noqa: E402

from sglang_flatcake.cluster import wire  # noqa: E402
from sglang_flatcake.cluster.owner_main import session_keys  # noqa: E402
from sglang_flatcake.cluster.redis_directory import RedisDirectory, redis_url_for_logs  # noqa: E402
from sglang_flatcake.cluster.requester import RemoteReader  # noqa: E402
from sglang_flatcake.cluster.secret import ClusterSecret  # noqa: E402
from sglang_flatcake.cluster.transfer import Engine  # noqa: E402
from sglang_flatcake.config import FlatCakeConfig  # noqa: E402
from sglang_flatcake.errors import ConfigError  # noqa: E402
from sglang_flatcake.layout import KVLayout  # noqa: E402
from sglang_flatcake.store import FlatCakeStore  # noqa: E402

LAYOUT = KVLayout.mha(layers=4, kv_heads=2, head_dim=64, dtype="bfloat16", page_tokens=16)
SECRET = node_secret(1)           # a member's (node 1); the owner is node 0
TK = SECRET.tenant_key("")        # tenant "": what a fetch proves it knows
BOUND = 1.0
SLACK = 0.75


def raw_read(attacker, peer, addr, n):
    buf = np.zeros(n, np.uint8)
    r = attacker.read(peer, [buf.ctypes.data], [addr], [n], BOUND)
    return r.ok, buf


# ---------------------------------------------------------------- finding 1: the data plane
def test_nothing_at_rest_is_reachable_through_the_transfer_engine(served, attacker):
    engine, svc, store, ssd, mem = served
    member = Engine("127.0.0.1")
    try:
        reader = RemoteReader(member, LAYOUT, SECRET, timeout_s=BOUND)
        out = empty(8)
        assert reader.fetch(svc.endpoint, "alice", mem, out).hits == 8
        np.testing.assert_array_equal(out, expected(mem))
        assert engine.registered_bytes == 0 and member.registered_bytes == 0
        arena = store.arena.buf
        for addr in (arena.ctypes.data, svc.staging.ctypes.data):   # memory tier, staging
            ok, got = raw_read(attacker, engine.session, addr, LAYOUT.block_bytes)
            assert not ok and not got.any()
            junk = np.full(LAYOUT.block_bytes, 0xAB, np.uint8)
            w = attacker._te.transfer_sync_write(engine.session, junk.ctypes.data, addr,
                                                 junk.nbytes)
            assert w != 0
        ok, _ = raw_read(attacker, member.session, reader.buf.ctypes.data, LAYOUT.block_bytes)
        assert not ok                                # the requester's receive buffer
        out[:] = 0                                   # the arena was not overwritten
        assert reader.fetch(svc.endpoint, "alice", mem, out).hits == 8
        np.testing.assert_array_equal(out, expected(mem))
    finally:
        member.close()


def test_bytes_written_into_a_granted_slot_are_a_miss_not_served(served, attacker):
    """While a grant is in flight its slot is registered (the data plane has no
    authentication): bytes an attacker writes there fail the writer's records."""
    engine, svc, _, ssd, _ = served
    member = Engine("127.0.0.1")
    try:
        def overwrite(grant):
            _, addr, n = grant["segments"][0]
            junk = np.full(n, 7, np.uint8)
            bb = LAYOUT.block_bytes
            sb = bb + 16                           # a sealed block: ciphertext and tag
            assert attacker._te.transfer_sync_write(grant["peer"], junk.ctypes.data,
                                                    addr + 3 * sb, bb) == 0
        out = empty(8)
        r = RemoteReader(member, LAYOUT, SECRET, timeout_s=BOUND).fetch(
            svc.endpoint, "", ssd, out, on_grant=overwrite)
        assert (r.hits, r.reason) == (3, "checksum")
        np.testing.assert_array_equal(out[:3], expected(ssd[:3]))
        assert not out[3:].any()
    finally:
        member.close()


# ---------------------------------------------------------------- findings 3, 5: no secret
def test_a_node_without_the_secret_gets_nothing(served):
    engine, svc, _, ssd, _ = served
    other = Engine("127.0.0.1")
    try:
        out = empty(8)
        r = RemoteReader(other, LAYOUT, node_secret(OUTSIDER),      # a key pair not in the roster
                         timeout_s=BOUND).fetch(svc.endpoint, "", ssd, out)
        assert r.hits == 0 and "not authenticated" in r.reason and not out.any()
        rep = send_raw(svc.endpoint, json.dumps({"op": "fetch", "tenant": "", "keys": ssd}).encode())
        assert b"not authenticated" in rep and b"lease" not in rep
    finally:
        other.close()


def test_tenant_tags_are_keyed():
    a, b = ClusterSecret(b"x" * 32), ClusterSecret(b"y" * 32)
    assert a.tag("user-0042") != b.tag("user-0042") and a.tag("user-0042") != a.tag("user-0043")
    import xxhash
    assert a.tag("user-0042") != xxhash.xxh3_128_hexdigest(b"user-0042")
    assert "x" not in repr(a)


def test_a_lying_owner_is_refused(served, attacker):
    """A fake owner (no secret) answers with a grant for its own forged bytes."""
    _, _, _, ssd, _ = served
    forged = np.full((8, LAYOUT.layers, LAYOUT.block_layer_bytes), 9, np.uint8)
    addr = attacker.register(forged)
    rep = zmq.Context.instance().socket(zmq.REP)
    port = rep.bind_to_random_port("tcp://127.0.0.1")
    member = Engine("127.0.0.1")
    try:
        out = empty(8)
        reader = RemoteReader(member, LAYOUT, SECRET, timeout_s=BOUND)
        import threading

        def lie():
            if rep.poll(3000):
                rep.recv()
                grant = {"hits": 8, "lease": "x", "peer": attacker.session,
                         "bytes": forged.nbytes, "segments": [[0, addr, forged.nbytes]],
                         "records": ["00" * 16] * 8}
                rep.send(b"\0" * 16 + json.dumps(grant).encode())
        t = threading.Thread(target=lie)
        t.start()
        r = reader.fetch(f"tcp://127.0.0.1:{port}", "", ssd, out)
        t.join()
        assert r.hits == 0 and "not authenticated" in r.reason and not out.any()
    finally:
        rep.close()
        attacker.unregister(addr)
        member.close()


def test_forged_directory_entries_and_leases_are_not_followed(redis_url):  # noqa: F811
    import redis
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    honest, reader = RedisDirectory(redis_url, SECRET), RedisDirectory(redis_url, SECRET)
    try:
        honest.join(1, "tcp://127.0.0.1:7001")
        keys = session_keys(6, "f")
        honest.publish("", "s", keys)
        assert reader.lookup("", keys).hits == 6
        # a Redis writer points the node's lease at its own endpoint (same incarnation)
        lease = r.get("fc:n:1")
        inc, _, mac = lease.split("|")
        r.set("fc:n:1", f"{inc}|tcp://10.6.6.6:1|{mac}", px=3000)
        assert reader.lookup("", keys).hits == 0
        r.set("fc:n:1", lease, px=3000)
        # ... or writes entries of its own for a fake node, under the tag it read from Redis
        page = next(k for k in r.scan_iter("fc:t:*:p:*"))
        prefix = page.rsplit(":p:", 1)[0] + ":p:"
        r.set("fc:n:9", "abcd|tcp://10.6.6.6:1|" + "0" * 32)
        from sglang_flatcake.cluster.redis_entries import page_name
        tag = prefix.split(":t:", 1)[1][:-3]
        for k in keys[3:]:       # (names are keyed: the test gives the attacker the right ones)
            r.set(prefix + page_name(SECRET, tag, k), "9|abcd|" + "0" * 32)
        found = reader.lookup("", keys)
        assert found.hits == 3 and 9 not in found.endpoints and reader.forged >= 1
    finally:
        honest.close()
        reader.close()


# ---------------------------------------------------------------- findings 4, 9: messages
def test_malformed_and_oversized_messages_are_answered_and_the_owner_keeps_serving(served):
    engine, svc, _, ssd, _ = served
    nested = b"[" * 100_000 + b"]" * 100_000
    for raw in (b"[]", b'"x"', b'{"op":"ack","lease":1e999}', nested, os.urandom(64), b""):
        rep = send_raw(svc.endpoint, raw)
        assert rep is not None and b"error" in rep, raw[:30]
    # a member's malformed requests (authenticated, wrong shapes) are answered too
    def n():
        return os.urandom(16).hex()
    for msg in ([], {"op": "ack", "lease": 1e308, "from": 1, "nonce": n(), "ts": time.time()},
                {"op": "fetch", "tag": 5, "keys": ssd, "from": 1, "nonce": n(),
                 "ts": time.time()},
                {"op": "fetch", "tag": "t", "keys": [[1]], "from": 1, "nonce": n(),
                 "ts": time.time()},
                {"op": "fetch", "tag": "t", "keys": ssd, "from": 1, "nonce": n(), "ts": 1.0}):
        rep = wire.unseal(SECRET, send_raw(svc.endpoint, wire.seal(SECRET, msg)))
        assert rep["error"].startswith("bad request"), msg
    rep = send_raw(svc.endpoint, b"\0" * (2 << 20))          # over the limit: an answer
    assert b"over the" in rep
    send_raw(svc.endpoint, b"\0" * (46 << 20), timeout=0.5)   # far over: dropped unread
    member = Engine("127.0.0.1")
    try:
        out = empty(8)
        r = RemoteReader(member, LAYOUT, SECRET, timeout_s=BOUND).fetch(svc.endpoint, "", ssd, out)
        assert r.hits == 8 and r.seconds < BOUND
        np.testing.assert_array_equal(out, expected(ssd))
    finally:
        member.close()


def test_an_unexpected_failure_is_answered_and_rolls_the_grant_back(served, monkeypatch):
    from sglang_flatcake.cluster import owner as owner_mod
    engine, svc, store, ssd, _ = served

    def broken(*a, **kw):
        raise RuntimeError("a bug")
    monkeypatch.setattr(owner_mod, "stage_run", broken)
    for _ in range(6):                              # more than the slots: none leaks
        rep = member_call(svc, wire.fetch_request(SECRET.tag(""), ssd, 1, TK))
        assert rep["error"] == "owner failed: RuntimeError"
    assert svc.held() == 0 and engine.registered_bytes == 0
    assert store.clear() == 2                       # no read lease left pinning a session


# ---------------------------------------------------------------- finding 6: grants
def member_call(svc, msg, secret=SECRET):
    return wire.unseal(secret, send_raw(svc.endpoint, wire.seal(secret, msg)))


def test_leases_are_unguessable_bound_to_their_requester_and_capped_per_peer(served):
    engine, svc, _, ssd, _ = served
    greedy, other = 1, node_secret(2)
    grants = [member_call(svc, wire.fetch_request(SECRET.tag(""), ssd, greedy, TK))
              for _ in range(3)]
    assert [g["hits"] for g in grants] == [8, 8, 0] and grants[2]["reason"] == "busy"
    assert len(grants[0]["lease"]) == 32 and grants[0]["lease"] != grants[1]["lease"]
    assert svc.held(greedy) == 2
    rep = member_call(svc, wire.fetch_request(SECRET.tag(""), ssd, 2, TK), other)
    assert rep["hits"] == 8                         # one peer cannot take every slot
    stolen = member_call(svc, wire.ack_request(grants[0]["lease"], 2), other)
    assert stolen == {"valid": False, "reason": "lease expired", "re": stolen["re"]}
    assert svc.held(greedy) == 2                    # another requester cannot cancel it
    assert member_call(svc, wire.ack_request(grants[0]["lease"], greedy))["valid"]
    assert svc.held(greedy) == 1


# ---------------------------------------------------------------- findings 7, 8: stalls
def test_a_stalled_peer_stops_only_its_own_restores_and_leaks_nothing(tmp_path, secret_file):  # noqa: F811
    slow, fine = (OwnerProcess(tmp_path / "slow", secret_file),
                  OwnerProcess(tmp_path / "fine", secret_file))
    member = Engine("127.0.0.1")
    try:
        reader = RemoteReader(member, LAYOUT, SECRET, max_blocks=16, timeout_s=0.4)
        out = empty(16)
        assert reader.fetch(fine.info["endpoint"], "", fine.keys, out).hits == 16
        out[:] = 0
        r = reader.fetch(slow.info["endpoint"], "", slow.keys, out,
                         on_grant=lambda g: os.kill(slow.proc.pid, signal.SIGSTOP))
        assert r.reason == "transfer timeout" and not out.any()
        assert reader.set_aside == 1 and member.registered_bytes == 0   # nothing reachable
        local = np.zeros(4096, np.uint8)
        te, addr = slow.info["te"], slow.info["raw_addr"]
        reasons = [member.read(te, [local.ctypes.data], [addr], [4096], 0.3).reason
                   for _ in range(3)]                # the stalled peer's reads pile up ...
        assert reasons == ["timeout", "too many late", "too many late"]
        assert member.late(te) == Engine.MAX_LATE_PER_PEER       # ... to its own cap
        assert member.late(fine.info["te"]) == 0
        # Mooncake 0.3.13's TCP transport queues this engine's other transfers behind the
        # stalled peer's (docs/cluster-security.md); once that peer is gone they move again
        slow.stop()
        r = reader.fetch(fine.info["endpoint"], "", fine.keys, out)
        assert (r.hits, r.reason) == (16, "")
        np.testing.assert_array_equal(out, expected(fine.keys))
        assert member.registered_bytes == 0
    finally:
        slow.stop()
        fine.stop()
        member.close()


# ---------------------------------------------------------------- finding 10: the directory
def test_a_node_id_taken_over_is_not_written_back_and_dead_incarnations_are_purged(redis_url):  # noqa: F811
    import redis
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = session_keys(10, "d")
    dead = RedisDirectory(redis_url, node_secret(4), lease_ms=300)
    dead.join(4, "tcp://127.0.0.1:7004")
    dead.publish("", "s", keys)
    dead._stop_beat()                                # the process stalls: no leave
    time.sleep(0.5)                                  # its lease lapses
    new = RedisDirectory(redis_url, node_secret(4), lease_ms=300)
    try:
        new.join(4, "tcp://127.0.0.1:7104", exclusive=True)
        assert new.purged == 10
        later = session_keys(10, "e")                # the restarted node stores other pages
        new.publish("", "s2", later)
        # its 10 entries, their session set, the node's set of sessions, its lease: nothing
        # of the dead incarnation's is left (the old code kept adding 1,001 keys a restart)
        assert len(list(r.scan_iter("fc:*"))) == 10 + 3
        keys = later
        assert new.lookup("", keys).endpoints == {4: "tcp://127.0.0.1:7104"}
        # the stalled process wakes up: its heartbeat must not take the id back
        dead._stop.clear()
        import threading
        dead._beat = threading.Thread(target=dead._heartbeat, daemon=True)
        dead._beat.start()
        time.sleep(0.4)
        assert dead.lost and r.get("fc:n:4").split("|")[1] == "tcp://127.0.0.1:7104"
        dead.close()                                 # nor does its leave drop the new lease
        assert r.get("fc:n:4") is not None and new.lookup("", keys).hits == 10
    finally:
        new.close()


def test_secrets_stay_out_of_urls_logs_and_flags(tmp_path):
    assert redis_url_for_logs("redis://:hunter2@10.0.0.1:6379/0") == "redis://:***@10.0.0.1:6379/0"
    assert "hunter2" not in redis_url_for_logs("rediss://app:hunter2@h:6380")
    p = tmp_path / "s"
    p.write_bytes(b"z" * 32)
    os.chmod(p, 0o644)
    with pytest.raises(ConfigError, match="readable by group or others"):
        ClusterSecret.from_file(str(p))
    os.chmod(p, 0o600)
    p.write_bytes(b"short")
    with pytest.raises(ConfigError, match="holds 5 bytes") as e:
        ClusterSecret.from_file(str(p))
    assert "short" not in str(e.value)
    from sglang_flatcake.cluster.node import ClusterNode
    cfg = FlatCakeConfig(cluster_directory="redis://127.0.0.1:6379/0", durable=False)
    with FlatCakeStore(tmp_path / "st", LAYOUT, cfg) as st:
        with pytest.raises(ConfigError, match="cluster_secret_file='' is not allowed"):
            ClusterNode(st, cfg)
