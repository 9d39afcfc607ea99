"""Issue 32, findings on the directory (a real redis-server, an attacker who can write Redis
but has no cluster secret): junk on a node's lease key does not evict it and the heartbeat
never dies; planted malformed entries are misses logged once, never exceptions; page keys in
Redis are keyed by the secret, so a Redis reader cannot tell which prompts are cached."""

from __future__ import annotations

import logging
import time

import pytest

redis = pytest.importorskip("redis", reason="PyPI redis client missing")

from tests.support.cluster_keys import node_secret  # noqa: E402

from sglang_flatcake.cluster.owner_main import session_keys  # noqa: E402
from sglang_flatcake.cluster.redis_directory import RedisDirectory  # noqa: E402

SECRET = node_secret(1)
EP = "tcp://127.0.0.1:7001"


@pytest.fixture
def pair(redis_url):
    honest = RedisDirectory(redis_url, SECRET, lease_ms=300)
    reader = RedisDirectory(redis_url, SECRET, lease_ms=300)
    honest.join(1, EP)
    yield honest, reader, redis.Redis.from_url(redis_url)
    honest.close()
    reader.close()


def settle(cond, seconds=2.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end and not cond():
        time.sleep(0.02)
    return cond()


@pytest.mark.parametrize("junk", ["SET", "SET-EMPTY", "LIST"])
def test_junk_on_the_lease_key_is_overwritten_and_the_node_stays(pair, junk):
    honest, reader, r = pair
    keys = session_keys(4, "h")
    honest.publish("", "s", keys)
    assert reader.lookup("", keys).hits == 4
    r.delete("fc:n:1")
    if junk == "LIST":
        r.rpush("fc:n:1", "x")
    else:
        r.set("fc:n:1", b"" if junk == "SET-EMPTY" else b"\xff\xfejunk|tcp://10.6.6.6:1|00")
    assert settle(lambda: reader.lookup("", keys).hits == 4), r.type("fc:n:1")
    assert not honest.lost and honest.overwritten >= 1
    time.sleep(0.4)                                   # more than a lease: it keeps beating
    assert reader.lookup("", keys).hits == 4


def test_a_valid_lease_of_another_incarnation_still_takes_the_id(pair, redis_url):
    honest, reader, r = pair
    other = RedisDirectory(redis_url, SECRET, lease_ms=300)
    try:
        other.join(1, "tcp://127.0.0.1:7101")          # not exclusive: takes the id over
        assert settle(lambda: honest.lost)
    finally:
        other.close()


def test_the_heartbeat_survives_an_unexpected_failure(pair, monkeypatch):
    honest, reader, r = pair
    real, calls = honest._beat_cas, []

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) <= 2:
            raise RuntimeError("a bug in a beat")
        return real(*a, **kw)
    monkeypatch.setattr(honest, "_beat_cas", flaky)
    keys = session_keys(2, "b")
    honest.publish("", "s", keys)
    assert settle(lambda: len(calls) >= 4)
    time.sleep(0.4)                                   # past the lease: refreshed again
    assert reader.lookup("", keys).hits == 2 and not honest.lost


@pytest.mark.parametrize("value", [b"\xff\xfe|x|y", "\u00b2|abc|" + "0" * 32, "9" * 5000 + "|a|b",
                                   "1|", "||", "1|a|b|c", b"\x00"])
def test_planted_entries_are_misses_logged_once(pair, value, caplog):
    honest, reader, r = pair
    caplog.set_level(logging.WARNING, logger="sglang_flatcake")
    keys = session_keys(6, "p")
    honest.publish("", "s", keys)
    page_keys = sorted(k for k in r.scan_iter("fc:t:*:p:*"))
    assert len(page_keys) == 6
    found = reader.lookup("", keys)
    # plant the value on the entry of the 4th key (found by trying each: names are keyed)
    for pk in page_keys:
        old = r.get(pk)
        r.set(pk, value)
        hits = reader.lookup("", keys).hits
        if hits == 3:
            break
        r.set(pk, old)
    else:
        pytest.fail("no page key held the 4th entry")
    for _ in range(3):
        assert reader.lookup("", keys).hits == 3
    assert found.hits == 6
    assert sum("malformed" in m for m in caplog.messages) == 1, caplog.messages
    if isinstance(value, str) and value.startswith("9" * 10):     # a planted lease too
        r.set("fc:n:" + "9" * 5000, "x|y|z")
        assert reader.lookup("", keys).hits == 3


def test_a_wrong_typed_page_key_is_a_miss_not_a_directory_failure(pair):
    honest, reader, r = pair
    keys = session_keys(3, "w")
    honest.publish("", "s", keys)
    (pk,) = [k for k in r.scan_iter("fc:t:*:p:*")][:1]
    r.delete(pk)
    r.rpush(pk, "x")
    assert reader.lookup("", keys).hits in (0, 1, 2)     # a miss there, not an exception


def test_redis_holds_no_page_key_in_the_clear(pair):
    honest, reader, r = pair
    keys = session_keys(5, "c")
    honest.publish("tenant-a", "s", keys)
    seen = []
    for k in r.scan_iter("*"):
        seen.append(k)
        if r.type(k) == b"set":
            seen.extend(r.smembers(k))
        elif r.type(k) == b"string":
            seen.append(r.get(k))
    blob = b"\n".join(seen)
    assert not any(k.encode() in blob or k[:16].encode() in blob for k in keys)
    assert reader.lookup("tenant-a", keys).hits == 5
    assert reader.lookup("tenant-b", keys).hits == 0
