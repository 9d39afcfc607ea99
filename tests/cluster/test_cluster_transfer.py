"""Two processes: an owner node (a real FlatCakeStore on real files, served through the
Transfer Engine) and this test as the requester.  Killed, stopped and reclaiming owners
are misses within the bound, never wrong bytes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed "
                    "(pip install mooncake-transfer-engine-non-cuda)")
pytest.importorskip("zmq", reason="pyzmq not installed")

from tests.support.cluster_keys import node_secret, write_node_files  # noqa: E402

from sglang_flatcake.cluster.redis_directory import RedisDirectory  # noqa: E402
from sglang_flatcake.cluster.owner_main import session_blocks, session_keys  # noqa: E402
from sglang_flatcake.cluster.requester import RemoteReader as _Reader  # noqa: E402
from sglang_flatcake.cluster.seal import sealed_bytes  # noqa: E402
from sglang_flatcake.cluster.transfer import Engine  # noqa: E402
from sglang_flatcake.layout import KVLayout  # noqa: E402

LAYOUT = KVLayout.mha(layers=4, kv_heads=2, head_dim=64, dtype="bfloat16", page_tokens=16)
BOUND = 1.0          # the requester's timeout_s
SECRET = node_secret(1)                  # the requester's (owners are node 0, or --node)
SB = sealed_bytes(LAYOUT.block_bytes)    # a block on the wire: its ciphertext and tag


def RemoteReader(engine, layout, **kw):
    return _Reader(engine, layout, SECRET, **kw)
SLACK = 0.5          # thread start-up and scheduling on a loaded 2-core machine


class Owner:
    def __init__(self, root, secret, blocks=48, extra=()):
        self.keys = session_keys(blocks, "a")
        node = int(extra[list(extra).index("--node") + 1]) if "--node" in extra else 0
        key, roster = write_node_files(f"{root}-keys", node)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_flatcake.cluster.owner_main", "--root", str(root),
             "--blocks", str(blocks), "--secret-file", secret, "--node-key-file", key,
             "--roster-file", roster, *(() if "--node" in extra else ("--node", "0")), *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"owner process exited with {self.proc.wait()}")
        self.info = json.loads(line)
        self.endpoint = self.info["endpoint"]

    def command(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def kill(self, sig=signal.SIGKILL) -> None:
        os.kill(self.proc.pid, sig)
        if sig == signal.SIGKILL:
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def engine():
    e = Engine("127.0.0.1")
    yield e
    e.close()


@pytest.fixture
def owner(tmp_path, secret_file):  # noqa: F811
    made = []

    def _owner(**kw):
        o = Owner(tmp_path / f"store{len(made)}", secret_file, **kw)
        made.append(o)
        return o

    yield _owner
    for o in made:
        o.stop()


def expected(keys):
    return session_blocks(LAYOUT.block_bytes, keys).reshape(len(keys), LAYOUT.layers,
                                                            LAYOUT.block_layer_bytes)


def empty(n):
    return np.zeros((n, LAYOUT.layers, LAYOUT.block_layer_bytes), np.uint8)


@pytest.mark.parametrize("chunk", [0, 20])
def test_ssd_session_restored_from_another_process(engine, owner, chunk):
    o = owner()
    assert o.info["blocks_ssd"] == 48
    out = empty(48)
    grants = []
    r = RemoteReader(engine, LAYOUT, timeout_s=BOUND, chunk_blocks=chunk).fetch(
        o.endpoint, "", o.keys, out, on_grant=grants.append)
    assert (r.hits, r.reason, r.bytes) == (48, "", 48 * SB)
    assert [g["hits"] for g in grants] == ([48] if chunk == 0 else [20, 20, 8])
    # merged reads: one command per layer per chunk, never per block
    assert 0 < r.owner_read_commands <= LAYOUT.layers * len(grants)
    np.testing.assert_array_equal(out, expected(o.keys))


def test_memory_tier_session_and_partial_request(engine, owner):
    o = owner(extra=("--memory-bytes", str(64 << 20)))
    assert o.info["blocks_memory"] == 48
    asked = o.keys[:20] + ["not-stored"] + o.keys[21:]
    out = empty(len(asked))
    grants = []
    r = RemoteReader(engine, LAYOUT, timeout_s=BOUND).fetch(o.endpoint, "", asked, out,
                                                            on_grant=grants.append)
    assert r.hits == 20
    np.testing.assert_array_equal(out[:20], expected(o.keys[:20]))
    assert not out[20:].any()
    # sealed into the owner's staging slot (the arena is never registered)
    staging = (o.info["staging_addr"], o.info["staging_addr"] + 2 * 48 * SB)
    segs = [s for g in grants for s in g["segments"]]
    assert sum(s[2] for s in segs) == 20 * SB
    assert all(staging[0] <= s[1] < staging[1] for s in segs), (segs, staging)


def test_an_ssd_run_is_one_segment_and_grants_must_tile_their_blocks(engine, owner):
    from sglang_flatcake.cluster.wire import grant_fields

    def _segments_fit(segs, n, bb):
        g = {"hits": n, "bytes": n * bb, "segments": segs, "records": ["r"] * n,
             "lease": "l", "peer": "p"}
        return grant_fields(g, n, bb) is not None
    o = owner(blocks=16)
    grants = []
    r = RemoteReader(engine, LAYOUT, timeout_s=BOUND).fetch(o.endpoint, "", o.keys, empty(16),
                                                            on_grant=grants.append)
    assert r.hits == 16 and [g["segments"] for g in grants] == \
        [[[0, grants[0]["segments"][0][1], 16 * SB]]]
    reader = RemoteReader(engine, LAYOUT, timeout_s=BOUND)
    assert reader.fetch(o.endpoint, "", o.keys, None).hits == 16     # no copy: in the buffer
    np.testing.assert_array_equal(reader.buf[:16], expected(o.keys))
    bb = LAYOUT.block_bytes
    assert _segments_fit([[0, 1, 2 * bb], [2, 9, bb]], 3, bb)
    assert not _segments_fit([[0, 1, 2 * bb], [3, 9, bb]], 4, bb)      # a hole
    assert not _segments_fit([[0, 1, bb + 1]], 1, bb)                  # not whole blocks
    assert not _segments_fit([[0, 1, 2 * bb]], 1, bb)                  # past the grant
    assert not _segments_fit([[0, 1.5, bb]], 1, bb)                    # not an int


def test_found_through_the_directory(engine, owner, redis_url):  # noqa: F811
    o = owner(extra=("--redis", redis_url, "--node", "7", "--tenant", "acme"))
    d = RedisDirectory(redis_url, SECRET)
    try:
        look = d.lookup("acme", o.keys + ["tail-not-stored"])
        assert (look.hits, set(look.owners), look.endpoints) == (48, {7}, {7: o.endpoint})
        out = empty(48)
        r = RemoteReader(engine, LAYOUT, timeout_s=BOUND).fetch(
            look.endpoints[7], "acme", o.keys[:look.hits], out)
        assert r.hits == 48
        np.testing.assert_array_equal(out, expected(o.keys))
        o.kill()                       # the owner dies: its lease lapses, its entries go
        gone = threading.Event()
        while not gone.wait(0.05):
            if d.lookup("acme", o.keys).hits == 0:
                gone.set()
    finally:
        d.close()


def test_tenants_apart_on_the_owner(engine, owner, redis_url):  # noqa: F811
    o = owner(extra=("--redis", redis_url, "--node", "3", "--tenant", "a"))
    out = empty(48)
    r = RemoteReader(engine, LAYOUT, timeout_s=BOUND).fetch(o.endpoint, "b", o.keys, out)
    assert (r.hits, r.reason) == (0, "not published")
    assert not out.any()
    d = RedisDirectory(redis_url, SECRET)
    assert d.lookup("b", o.keys).hits == 0 and d.lookup("a", o.keys).hits == 48
    d.close()


def test_owner_killed_before_request_is_a_miss_within_bound(engine, owner):
    o = owner()
    o.kill()
    out = empty(48)
    r = RemoteReader(engine, LAYOUT, timeout_s=BOUND).fetch(o.endpoint, "", o.keys, out)
    assert (r.hits, r.reason) == (0, "owner timeout")
    assert r.seconds <= BOUND + SLACK
    assert not out.any()


def test_owner_killed_mid_session_is_a_miss_within_bound(engine, owner):
    o = owner()
    out = empty(48)
    r = RemoteReader(engine, LAYOUT, timeout_s=BOUND).fetch(
        o.endpoint, "", o.keys, out, on_grant=lambda g: o.kill())
    assert r.hits == 0 and r.reason in ("transfer failed", "transfer timeout")
    assert r.seconds <= BOUND + SLACK
    assert not out.any()


def test_stopped_owner_is_a_miss_and_its_buffer_is_set_aside(engine, owner):
    o = owner()
    reader = RemoteReader(engine, LAYOUT, timeout_s=BOUND)
    first = reader.landing
    out = empty(48)
    r = reader.fetch(o.endpoint, "", o.keys, out, on_grant=lambda g: o.kill(signal.SIGSTOP))
    assert (r.hits, r.reason) == (0, "transfer timeout")
    assert r.seconds <= BOUND + SLACK
    assert reader.landing is not first              # a late write can land only in `first`
    assert not out.any()
    os.kill(o.proc.pid, signal.SIGCONT)             # the owner is back: served again,
    end = time.monotonic() + 5                      # once its late transfer has ended (a
    while reader.set_aside and time.monotonic() < end:   # fetch before is a miss: one
        time.sleep(0.02)                            # late buffer per owner)
    assert reader.set_aside == 0
    r = reader.fetch(o.endpoint, "", o.keys, out)
    assert r.hits == 48
    np.testing.assert_array_equal(out, expected(o.keys))


@pytest.mark.parametrize("chunk", [0, 16])
def test_session_pinned_during_transfer_then_reclaimed(engine, owner, redis_url,  # noqa: F811
                                                       chunk):
    """A reclaim between the owner's grant and the requester's ack cannot take the session
    (the owner holds the store's read lease until the ack): the transfer is served whole with
    the right bytes; once acked, the reclaim frees it and the directory forgets it."""
    o = owner(extra=("--redis", redis_url, "--node", "2"))
    cleared = []
    out = empty(48)
    r = RemoteReader(engine, LAYOUT, timeout_s=5.0, chunk_blocks=chunk).fetch(
        o.endpoint, "", o.keys, out, on_grant=lambda g: cleared.append(o.command("clear")))
    assert cleared and all(c == {"cleared": 0} for c in cleared)
    assert (r.hits, r.reason) == (48, "")
    np.testing.assert_array_equal(out, expected(o.keys))
    assert o.command("clear") == {"cleared": 1}
    d = RedisDirectory(redis_url, SECRET)
    assert d.lookup("", o.keys).hits == 0           # the sweep removed the session's entries
    d.close()
    out[:] = 0
    r = RemoteReader(engine, LAYOUT, timeout_s=BOUND).fetch(o.endpoint, "", o.keys, out)
    assert (r.hits, r.reason) == (0, "not published")   # reclaimed before any pin: a clean miss
    assert not out.any()


def test_lease_expired_before_ack_is_a_miss(engine, owner):
    o = owner(extra=("--lease-s", "0.2"))
    out = empty(48)
    r = RemoteReader(engine, LAYOUT, timeout_s=5.0).fetch(
        o.endpoint, "", o.keys, out, on_grant=lambda g: threading.Event().wait(0.4))
    assert (r.hits, r.reason) == (0, "lease expired")
    assert not out.any()


def test_checksum_mismatch_cuts_the_run(engine, owner):
    o = owner()
    out = empty(48)

    def spoil(grant):
        grant["records"][30] = "00" * 16           # block 30's record no longer matches

    r = RemoteReader(engine, LAYOUT, timeout_s=BOUND).fetch(o.endpoint, "", o.keys, out,
                                                            on_grant=spoil)
    assert (r.hits, r.reason) == (30, "checksum")
    np.testing.assert_array_equal(out[:30], expected(o.keys[:30]))
    assert not out[30:].any()


def test_read_returns_only_once_every_entry_has_landed(engine):
    """A read ends when its whole batch has (one entry: polled with sleeps; several: the
    engine's own status call, since its single-entry check looks at the first entry only),
    and ``start_read`` lets two reads move at once."""
    peer = Engine("127.0.0.1")
    try:
        src = np.random.default_rng(7).integers(0, 256, 24 << 20, np.uint8)
        src_addr = peer.register(src)
        for entries in ([(0, 4096), (4096, (24 << 20) - 4096)], [(0, 24 << 20)]):
            dst = np.zeros(24 << 20, np.uint8)
            dst_addr = engine.register(dst)
            r = engine.read(peer.session, [dst_addr + o for o, _ in entries],
                            [src_addr + o for o, _ in entries], [n for _, n in entries], BOUND)
            assert r.ok, r.reason
            np.testing.assert_array_equal(dst, src)
        dst = np.zeros(24 << 20, np.uint8)
        dst_addr = engine.register(dst)
        half = 12 << 20
        jobs = [engine.start_read(peer.session, [dst_addr + o], [src_addr + o], [half])
                for o in (0, half)]
        assert all(j.wait(BOUND).ok for j in jobs)
        assert jobs[0].wait(0).ok                   # a second wait gives the first answer
        np.testing.assert_array_equal(dst, src)
    finally:
        peer.close()


class _StatusFailsFirst:
    """Mooncake's real TransferEngine, but the first ``fail`` batches it finishes report
    failure (after really landing): what a dead pooled tcp connection looks like to us."""

    def __init__(self, real, fail: int) -> None:
        self.real, self.fail = real(), fail

    def __getattr__(self, name):
        return getattr(self.real, name)

    def _lie(self, st_ok: bool, st):
        if st_ok and self.fail > 0:
            self.fail -= 1
            return -1
        return st

    def transfer_check_status(self, bid):
        while (st := self.real.transfer_check_status(bid)) == 0:
            time.sleep(0.0005)
        return self._lie(st == 1, st)

    def get_batch_transfer_status(self, bids):
        st = self.real.get_batch_transfer_status(bids)
        return self._lie(st == 0, st)


@pytest.mark.parametrize("fail", [1, 2])
def test_a_failed_batch_is_sent_once_more(monkeypatch, fail):
    """One failed batch is retried and lands; a peer that fails twice is a failed read
    (one retry, within the caller's bound)."""
    import mooncake.engine as mooncake_engine
    peer = Engine("127.0.0.1")
    real = mooncake_engine.TransferEngine
    made: list[_StatusFailsFirst] = []
    monkeypatch.setattr(mooncake_engine, "TransferEngine",
                        lambda: made.append(_StatusFailsFirst(real, fail)) or made[-1])
    flaky = Engine("127.0.0.1")
    try:
        src = np.random.default_rng(3).integers(0, 256, 1 << 20, np.uint8)
        src_addr = peer.register(src)
        for entries in ([(0, 1 << 20)], [(0, 4096), (4096, (1 << 20) - 4096)]):
            before = flaky.retried
            made[0].fail = fail
            dst = np.zeros(1 << 20, np.uint8)
            r = flaky.read(peer.session, [dst.ctypes.data + o for o, _ in entries],
                           [src_addr + o for o, _ in entries], [n for _, n in entries], BOUND)
            assert flaky.retried - before == 1
            if fail == 1:
                assert r.ok, r.reason
                np.testing.assert_array_equal(dst, src)
            else:
                assert (r.ok, r.reason) == (False, "failed")
    finally:
        flaky.close()
        peer.close()


def test_bad_arguments(engine):
    from sglang_flatcake.errors import ConfigError
    with pytest.raises(ConfigError, match="timeout_s=0"):
        RemoteReader(engine, LAYOUT, timeout_s=0)
    with pytest.raises(ConfigError, match="host='localhost'"):
        Engine("localhost")
    with pytest.raises(ConfigError, match="protocol='udp'"):
        Engine("127.0.0.1", protocol="udp")


def test_owner_store_closed_is_a_miss_and_the_service_keeps_serving(engine, tmp_path):
    """In one process: the owner's store refuses (closed) -> the fetch is a miss with the
    store's reason, and the service thread is still there to answer the next request."""
    from sglang_flatcake.cluster.owner import OwnerService
    from sglang_flatcake.config import FlatCakeConfig
    from sglang_flatcake.store import FlatCakeStore
    store = FlatCakeStore(tmp_path / "s", LAYOUT, FlatCakeConfig(memory_bytes=0, durable=False))
    keys = session_keys(8, "a")
    store.put(keys, session_blocks(LAYOUT.block_bytes, keys))
    svc = OwnerService(store, engine, node_secret(0), slot_blocks=8)
    try:
        svc.publish("", "s", keys)
        reader = RemoteReader(engine, LAYOUT, timeout_s=BOUND)
        out = empty(8)
        assert reader.fetch(svc.endpoint, "", keys, out).hits == 8
        np.testing.assert_array_equal(out, expected(keys))
        assert len(svc._free) == 4 and store.clear() == 1    # acked: no pin left behind
        out[:] = 0
        r = reader.fetch(svc.endpoint, "", keys, out)       # reclaimed, not yet swept
        assert (r.hits, r.reason) == (0, "not stored") and not out.any()
        store.close()
        out[:] = 0
        r = reader.fetch(svc.endpoint, "", keys, out)
        assert r.hits == 0 and r.reason.startswith("owner store:") and "closed" in r.reason
        assert not out.any()
        for _ in range(3):                          # more refusals than slots: none leaks
            assert reader.fetch(svc.endpoint, "", keys, out).reason.startswith("owner store:")
        assert len(svc._free) == 4
        r = reader.fetch(svc.endpoint, "", ["unknown"], out)
        assert (r.hits, r.reason) == (0, "not published")
    finally:
        svc.close()
        store.close()
