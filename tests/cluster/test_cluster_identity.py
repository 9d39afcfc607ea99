"""Issue 32, findings "one member breaks every tenant" and "caps that one party can fill": a
fetch must prove it knows the tenant's key (derived from its ``cache_salt``), not just its
tag (which Redis shows); two stalled peers cannot stop a requester's restores from others;
and a member with its own valid key (``identity``) cannot act as another node: sign its
directory entries or leases, take grants under its name, or open a grant between two others."""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed")
pytest.importorskip("zmq", reason="pyzmq not installed")

from tests.support.cluster_owner import (MEMBER, OWNER, OwnerProcess, attacker,  # noqa: E402,F401
                                         empty, expected, layout, secret, send_raw, served)

from sglang_flatcake.cluster import wire  # noqa: E402
from sglang_flatcake.cluster.requester import RemoteReader  # noqa: E402
from sglang_flatcake.cluster.transfer import Engine  # noqa: E402

SECRET = secret()


def call(svc, msg, s=SECRET):
    return wire.unseal(s, send_raw(svc.endpoint, wire.seal(s, msg)))


def test_a_fetch_by_tag_alone_is_refused(served):
    """A member that read alice's tag in Redis but does not know her salt gets nothing."""
    _, svc, _, _, mem = served
    tag = SECRET.tag("alice")
    for key in (SECRET.tenant_key("mallory"), None):
        msg = wire.fetch_request(tag, mem, MEMBER, key or b"\0" * 32)
        if key is None:
            msg.pop("proof")
        rep = call(svc, msg)
        assert rep.get("hits", 0) == 0 and "tenant" in rep.get("error", ""), rep
    assert svc.held() == 0
    rep = call(svc, wire.fetch_request(tag, mem, MEMBER, SECRET.tenant_key("alice")))
    assert rep["hits"] == 8                          # with the salt's key: served
    assert call(svc, wire.ack_request(rep["lease"], MEMBER))["valid"]


class StallingMember:
    """A member (it holds the secret) whose owner service answers every fetch with a
    well-formed grant on ``te``, a Transfer Engine that never serves (a stopped process)."""

    def __init__(self, te: str, addr: int, unit: int, node: int):
        import threading
        import zmq
        self.sock = zmq.Context.instance().socket(zmq.REP)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.grant = {"hits": 1, "lease": "l" * 32, "peer": te, "bytes": unit,
                      "segments": [[0, addr, unit]], "records": ["00" * 16]}
        self.secret = secret(node)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while not self.stop.is_set():
            if self.sock.poll(50):
                req = wire.unseal(self.secret, self.sock.recv())
                self.sock.send(wire.seal(self.secret, {**self.grant, "re": req["nonce"]}))

    def close(self):
        self.stop.set()
        self.thread.join()
        self.sock.close()


def test_two_stalled_peers_do_not_stop_restores_from_a_third(tmp_path, secret_file):  # noqa: F811
    from sglang_flatcake.cluster.seal import sealed_bytes
    slow = [OwnerProcess(tmp_path / f"slow{i}", secret_file) for i in range(2)]
    fine = OwnerProcess(tmp_path / "fine", secret_file)
    unit = sealed_bytes(layout().block_bytes)
    stallers = [StallingMember(o.info["te"], o.info["raw_addr"], unit, 4 + i)
                for i, o in enumerate(slow)]
    member = Engine("127.0.0.1")
    try:
        reader = RemoteReader(member, layout(), SECRET, max_blocks=16, timeout_s=0.4)
        out = empty(16)
        for o in slow:
            os.kill(o.proc.pid, signal.SIGSTOP)       # their engines never serve again
        for st in stallers:                           # each peer's grants stall, often
            for _ in range(3):
                r = reader.fetch(st.endpoint, "", fine.keys, out)
                assert r.hits == 0 and not out.any()
        assert reader.set_aside <= 2                  # one late buffer per stalled peer
        # the reader itself does not refuse the third peer (Mooncake 0.3.13's TCP transport
        # may still queue the transfer behind the stalled ones: docs/cluster-security.md)
        r = reader.fetch(fine.endpoint, "", fine.keys, out)
        assert r.reason != "too many late transfers", r
        for o in slow:
            o.stop()                                  # killed: the engine's queue moves
        end = time.monotonic() + 5
        while reader.set_aside and time.monotonic() < end:   # the late transfers fail
            time.sleep(0.05)
        r = reader.fetch(fine.endpoint, "", fine.keys, out)
        assert (r.hits, r.reason) == (16, ""), r
        assert (out == expected(fine.keys)).all()
    finally:
        for st in stallers:
            st.close()
        for o in slow + [fine]:
            o.stop()
        member.close()


# ------------------------------------------------ a member impersonating another node
# Each attacker below holds the cluster secret and its own valid key (node 3, in the roster):
# all a compromised member has.  ``forge`` is the best signature it can make in another
# node's name (its own key: it holds no other).
INTRUDER = 3


def forge(purpose: bytes, *parts) -> str:
    return secret(INTRUDER).identity.sign(purpose, *parts).hex()


def test_a_member_cannot_sign_entries_or_leases_in_another_nodes_name(redis_url):  # noqa: F811
    import redis
    from sglang_flatcake.cluster.owner_main import session_keys
    from sglang_flatcake.cluster.redis_directory import RedisDirectory
    from sglang_flatcake.cluster.redis_entries import page_name
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    honest, reader = RedisDirectory(redis_url, secret(2)), RedisDirectory(redis_url, SECRET)
    try:
        honest.join(2, "tcp://127.0.0.1:7002")
        keys = session_keys(6, "i")
        honest.publish("", "s", keys[:3])
        assert reader.lookup("", keys).hits == 3
        tag, inc = SECRET.tag(""), r.get("fc:n:2").split("|")[0]
        # entries for pages node 2 never stored, in node 2's name and incarnation
        for k in keys[3:]:
            r.set(f"fc:t:{tag}:p:{page_name(SECRET, tag, k)}",
                  f"2|{inc}|{forge(b'entry', tag, k, 2, inc)}")
        found = reader.lookup("", keys)
        assert found.hits == 3 and reader.forged == 1, found
        # node 2's lease pointed at the intruder's endpoint (same incarnation)
        evil = "tcp://127.0.0.1:7666"
        r.set("fc:n:2", f"{inc}|{evil}|{forge(b'lease', 2, inc, evil)}", px=3000)
        found = reader.lookup("", keys)
        assert found.hits == 0 and evil not in found.endpoints.values(), found
        # the intruder's own entries and lease (its own name) still count: it is a member
        r.set("fc:n:3", f"{'ab' * 8}|{evil}|{forge(b'lease', 3, 'ab' * 8, evil)}", px=3000)
        r.set(f"fc:t:{tag}:p:{page_name(SECRET, tag, keys[0])}",
              f"3|{'ab' * 8}|{forge(b'entry', tag, keys[0], 3, 'ab' * 8)}")
        assert reader.lookup("", keys[:1]).endpoints == {3: evil}
    finally:
        honest.close()
        reader.close()


def test_a_member_cannot_take_an_owners_slots_under_other_names(served):
    """The owner has 4 slots and grants at most 2 per requester: an intruder signing
    requests with its own key but naming other nodes (in ``from`` or in the header) gets
    nothing, so it holds at most 2 slots and an honest member is still served."""
    _, svc, _, ssd, _ = served
    me = secret(INTRUDER)
    tag, tk = me.tag(""), me.tenant_key("")
    for name in (2, 4, 5, 6, 7):
        rep = call(svc, wire.fetch_request(tag, ssd, name, tk), me)     # ``from``: another
        assert rep.get("hits", 0) == 0 and "sender" in rep.get("error", ""), rep
        raw = bytearray(wire.seal(me, wire.fetch_request(tag, ssd, INTRUDER, tk)))
        raw[wire.SIG_BYTES + 1:wire.SIG_BYTES + 3] = name.to_bytes(2, "little")   # header
        rep = wire.unseal(me, send_raw(svc.endpoint, bytes(raw)))
        assert rep.get("hits", 0) == 0 and "not authenticated" in rep.get("error", ""), rep
        raw = bytearray(wire.seal_to(me, wire.fetch_request(tag, ssd, INTRUDER, tk), OWNER))
        raw[wire.SIG_BYTES + 1:wire.SIG_BYTES + 3] = name.to_bytes(2, "little")   # MAC'd
        rep = wire.unseal(me, send_raw(svc.endpoint, bytes(raw)))
        assert rep.get("hits", 0) == 0 and "not authenticated" in rep.get("error", ""), rep
    own = [call(svc, wire.fetch_request(tag, ssd, INTRUDER, tk), me) for _ in range(3)]
    assert [g["hits"] for g in own] == [8, 8, 0] and svc.held() == svc.held(INTRUDER) == 2
    rep = call(svc, wire.fetch_request(tag, ssd, MEMBER, tk))
    assert rep["hits"] == 8 and svc.held(MEMBER) == 1


def test_a_third_member_cannot_open_a_grant_it_saw(served, attacker):
    """Node 1 fetches from node 0; the intruder sees the request's nonce and reads the
    sealed slot through the Transfer Engine, yet no key it can derive opens a block."""
    import numpy as np
    from sglang_flatcake.cluster.seal import grant_cipher, open_block, sealed_bytes
    _, svc, _, ssd, _ = served
    lay, seen = layout(), []

    def snoop(grant):
        _, addr, n = grant["segments"][0]
        buf = np.zeros(n, np.uint8)
        assert attacker.read(grant["peer"], [buf.ctypes.data], [addr], [n], 1.0).ok
        seen.append((grant["re"], buf))
    member = Engine("127.0.0.1")
    try:
        out = empty(8)
        r = RemoteReader(member, lay, SECRET, timeout_s=5.0).fetch(svc.endpoint, "", ssd, out,
                                                                   on_grant=snoop)   # (load)
        assert r.hits == 8 and (out == expected(ssd)).all()
    finally:
        member.close()
    (nonce, sealed), = seen
    block = sealed[:sealed_bytes(lay.block_bytes)]
    me, tag, opened = secret(INTRUDER), SECRET.tag(""), np.zeros(lay.block_bytes, np.uint8)
    assert open_block(grant_cipher(SECRET, MEMBER, OWNER, nonce), 0, tag, ssd[0], block, opened)
    with pytest.raises(ValueError, match="holds no key"):       # not its grant: no pair key
        grant_cipher(me, MEMBER, OWNER, nonce)
    for asked, by in ((INTRUDER, OWNER), (MEMBER, INTRUDER), (INTRUDER, MEMBER)):
        assert not open_block(grant_cipher(me, asked, by, nonce), 0, tag, ssd[0], block, opened)


def test_an_owner_deleted_from_the_roster_is_a_miss_then_served_once_back(served):
    """The requester proved the owner once (its replies then MAC'd for it); the operator
    deletes the owner's line: the next fetch is a clean miss, not an exception from a pair
    key the roster no longer gives; listed again, it is served."""
    from sglang_flatcake.cluster.identity import parse_roster
    from tests.support.cluster_keys import roster_text
    _, svc, _, ssd, _ = served
    mine = secret(MEMBER)
    member = Engine("127.0.0.1")
    try:
        reader = RemoteReader(member, layout(), mine, timeout_s=5.0)
        assert reader.fetch(svc.endpoint, "", ssd, empty(8)).hits == 8      # proven
        mine.identity.replace_roster(parse_roster(roster_text([1, 2, 3])))
        out = empty(8)
        r = reader.fetch(svc.endpoint, "", ssd, out)
        assert r.hits == 0 and not out.any() and "not authenticated" in r.reason, r
        mine.identity.replace_roster(parse_roster(roster_text()))
        out = empty(8)
        assert reader.fetch(svc.endpoint, "", ssd, out).hits == 8 and (out == expected(ssd)).all()
    finally:
        member.close()
