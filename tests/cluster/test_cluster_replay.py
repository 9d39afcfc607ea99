"""Issue 32, finding "replay without the secret": a member's fetch request captured on the
wire and sent again within the freshness window must be refused (the owner remembers the
nonces it saw, in bounded memory), and replays must not hold the victim's grants."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed")
pytest.importorskip("zmq", reason="pyzmq not installed")

from tests.support.cluster_owner import (MEMBER, attacker, empty, expected,  # noqa: E402,F401
                                         layout, secret, send_raw, served)

from sglang_flatcake.cluster import wire  # noqa: E402
from sglang_flatcake.cluster.requester import RemoteReader  # noqa: E402
from sglang_flatcake.cluster.transfer import Engine  # noqa: E402

SECRET = secret()
TK = SECRET.tenant_key("")        # tenant "": what a fetch proves it knows


def test_a_captured_request_replayed_within_the_window_is_refused(served):
    engine, svc, _, ssd, _ = served
    captured = wire.seal(SECRET, wire.fetch_request(SECRET.tag(""), ssd, MEMBER, TK))
    first = wire.unseal(SECRET, send_raw(svc.endpoint, captured))
    assert first["hits"] == 8                         # the member's own request
    assert wire.unseal(SECRET, send_raw(svc.endpoint, wire.seal(
        SECRET, wire.ack_request(first["lease"], MEMBER))))["valid"]
    for _ in range(2):                                # the attacker sends the same bytes
        again = wire.unseal(SECRET, send_raw(svc.endpoint, captured))
        assert again.get("hits", 0) == 0 and "replayed" in again["error"], again
    assert svc.held() == 0 and engine.registered_bytes == 0
    member = Engine("127.0.0.1")
    try:                                              # the victim's next fetch is served
        out = empty(8)
        r = RemoteReader(member, layout(), SECRET, timeout_s=1.0).fetch(svc.endpoint, "", ssd, out)
        assert (r.hits, r.reason) == (8, "")
        assert (out == expected(ssd)).all()
    finally:
        member.close()


def test_the_nonce_record_is_bounded_and_refuses_what_it_cannot_remember():
    rec = wire.NonceRecord(capacity=4)
    now = time.time()
    for i in range(4):
        assert rec.admit(f"{i:016x}", now + i, now + i)
    assert not rec.admit(f"{0:016x}", now + 0.5, now + 5)       # seen: a replay
    assert rec.admit(f"{9:016x}", now + 9, now + 9)              # full: the oldest is dropped
    assert len(rec) == 4
    # a request as old as what was dropped can no longer be told apart from a replay
    assert not rec.admit(f"{0:016x}", now, now + 9)
    assert not rec.admit(f"{77:016x}", now - 1, now + 9)
    assert rec.admit(f"{78:016x}", now + 8, now + 9)
    # entries past the window are forgotten (memory stays bounded by the window too)
    later = now + 100 + wire.MAX_SKEW_S
    assert rec.admit(f"{79:016x}", later, later) and len(rec) == 1


def test_short_nonces_are_refused(served):
    _, svc, _, ssd, _ = served
    msg = wire.fetch_request(SECRET.tag(""), ssd, MEMBER, TK)
    msg["nonce"] = "ab"
    rep = wire.unseal(SECRET, send_raw(svc.endpoint, wire.seal(SECRET, msg)))
    assert rep.get("hits", 0) == 0 and "nonce" in rep["error"], rep
