"""A cluster node as the server runs it (``cluster/node.py``, ``publisher.py``,
``to_slots.py``): two nodes in one process, each a real FlatCakeStore on real files with its
own Transfer Engine (TCP loopback) and owner service, and a real redis-server as directory.
A session written on node 0 is restored into node 1's KV slots byte for byte; dead owners,
reclaimed sessions and other tenants are misses, never wrong bytes."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed "
                    "(pip install mooncake-transfer-engine-non-cuda)")
pytest.importorskip("zmq", reason="pyzmq not installed")

from tests.support import blocks_for, chain, free_port  # noqa: E402
from tests.support.cluster_keys import write_node_files  # noqa: E402

from sglang_flatcake.cluster.directory import DirectoryError  # noqa: E402
from sglang_flatcake.cluster.node import ClusterNode  # noqa: E402
from sglang_flatcake.cluster.to_slots import restore_with_remote  # noqa: E402
from sglang_flatcake.config import FlatCakeConfig  # noqa: E402
from sglang_flatcake.errors import ConfigError  # noqa: E402
from sglang_flatcake.layout import KVLayout  # noqa: E402
from sglang_flatcake.placement import WriteSignals  # noqa: E402
from sglang_flatcake.store import FlatCakeStore  # noqa: E402

LAY = KVLayout.mha(4, 2, 32, "bfloat16", 16)
N = 24
SLACK = 0.75         # thread start-up and scheduling on a loaded 2-core machine


def config(url, node, secret, timeout=1.0):
    """Node ``node``'s config; its key file and the roster beside the secret file."""
    key, roster = write_node_files(os.path.join(os.path.dirname(secret), "keys"), node)
    return FlatCakeConfig(memory_bytes=8 << 20, ssd_bytes=256 << 20, extent_bytes=1 << 20,
                          io_threads=2, durable=False, node_id=node, cluster_directory=url,
                          cluster_secret_file=secret, cluster_node_key_file=key,
                          cluster_roster_file=roster, remote_timeout_s=timeout)


@pytest.fixture
def nodes(tmp_path, redis_url, secret_file):  # noqa: F811
    made = []

    def make(node, timeout=1.0):
        cfg = config(redis_url, node, secret_file, timeout)
        st = FlatCakeStore(tmp_path / f"n{node}-{len(made)}", LAY, cfg)
        try:
            cn = ClusterNode(st, cfg)
        except BaseException:
            st.close()
            raise
        made.append((cn, st))
        return cn, st
    yield make
    for cn, st in made:
        cn.close()
        st.close()


def write(cn, st, keys, tenant="", turns=((0, 10), (10, 20), (20, N))):
    """Three turns (SSD, SSD, memory), each published as the backend does after its put."""
    data = blocks_for(LAY, keys)
    for t, (a, b) in enumerate(turns):
        sig = WriteSignals(turn=t, prev_reply_tokens=10 if t == 2 else 10_000)
        res = st.put(keys[a:b], data[a:b], prefix_keys=keys[:a], signals=sig)
        cn.publisher.note(tenant, str(res.session), keys[a:b])
    assert cn.publisher.wait_idle(10)
    return data


def pool(n_pages=N + 2):
    return [np.zeros((n_pages * LAY.page_tokens, 2, 32), np.uint16) for _ in range(LAY.layers)]


def slots_for(n):
    return np.arange(LAY.page_tokens, (n + 1) * LAY.page_tokens)     # page 0 is padding


def reference(st, keys):
    k, v = pool(), pool()
    assert st.restore_to_slots(keys, k, v, slots_for(len(keys))).hits == len(keys)
    return k, v


def test_session_written_on_node0_restored_into_node1_slots(nodes):
    (a, sa), (b, sb) = nodes(0), nodes(1)
    keys = chain(N)
    write(a, sa, keys)
    assert sa.stats()["blocks_memory"] == 4 and sa.stats()["blocks_ssd"] == 20
    span = b.lookup("", keys)
    assert span.keys == tuple(keys) and span.runs == ((a.service.endpoint, 0, N),)
    k, v = pool(), pool()
    res = restore_with_remote(sb, b, keys, span, k, v, slots_for(N))
    assert res.hits == N and res.error is None
    rk, rv = reference(sa, keys)
    for layer in range(LAY.layers):
        np.testing.assert_array_equal(k[layer], rk[layer])
        np.testing.assert_array_equal(v[layer], rv[layer])
    assert b.stats()["remote_blocks"] == N and a.stats()["published_keys"] == N
    grants = []                                 # memory blocks copied into the slot too
    b.reader.fetch(a.service.endpoint, "", keys, np.empty_like(b.reader.buf[:N]),
                   on_grant=grants.append)
    (g,) = grants
    assert [s[0] for s in g["segments"]] == [0] and g["from_ssd"] == 20
    arena = (sa.arena.buf.ctypes.data, sa.arena.buf.ctypes.data + sa.arena.buf.nbytes)
    assert not arena[0] <= g["segments"][0][1] < arena[1]   # never the arena in place
    assert a.engine.registered_bytes == 0       # acked: nothing registered at rest
    assert a.lookup("", keys) is None                  # a node never fetches from itself


def test_local_prefix_then_remote_tail(nodes):
    (a, sa), (b, sb) = nodes(0), nodes(1)
    keys = chain(N)
    data = write(a, sa, keys)
    sb.put(keys[:10], data[:10])                       # node 1 holds the first turn itself
    assert sb.exists(keys) == 10
    span = b.lookup("", keys[10:])
    assert span.keys == tuple(keys[10:])
    k, v = pool(), pool()
    res = restore_with_remote(sb, b, keys, span, k, v, slots_for(N))
    assert res.hits == N and res.from_ssd + res.from_memory == 10
    rk, _ = reference(sa, keys)
    np.testing.assert_array_equal(k[2], rk[2])
    with pytest.raises(ValueError, match="not the tail"):
        restore_with_remote(sb, b, keys[:12], span, k, v, slots_for(12))


def test_tenants_apart(nodes):
    (a, sa), (b, _) = nodes(0), nodes(1)
    keys = chain(8)
    write(a, sa, keys, tenant="alice", turns=((0, 8),))
    assert b.lookup("bob", keys) is None and b.lookup("", keys) is None
    assert len(b.lookup("alice", keys).keys) == 8


def test_reclaimed_session_leaves_the_directory(nodes):
    (a, sa), (b, _) = nodes(0), nodes(1)
    keys = chain(N)
    write(a, sa, keys)
    assert b.lookup("", keys) is not None
    assert sa.clear() >= 1                             # the reclaim listener wakes the sweep
    assert a.publisher.wait_idle(10)
    assert b.lookup("", keys) is None and a.stats()["swept_sessions"] >= 1


def test_owner_gone_is_a_miss_within_the_bound_and_the_tail_stays_untouched(nodes):
    (a, sa), (b, sb) = nodes(0, timeout=0.5), nodes(1, timeout=0.5)
    keys = chain(N)
    data = write(a, sa, keys)
    sb.put(keys[:10], data[:10])
    span = b.lookup("", keys[10:])
    a.service.close()                                  # stops answering; its lease lives on
    k, v = pool(), pool()
    sb.restore_to_slots(keys[:10], k, v, slots_for(10))   # numba compiles the scatter once
    k, v = pool(), pool()
    t = time.monotonic()
    res = restore_with_remote(sb, b, keys, span, k, v, slots_for(N))
    took = time.monotonic() - t
    assert res.hits == 10 and took < 0.5 + SLACK, took
    assert not k[0][11 * LAY.page_tokens:].any()       # nothing written past the local run
    assert b.stats()["remote_misses"] == 1


def test_a_left_node_is_gone_and_a_node_id_is_taken_once(nodes):
    (a, sa), (b, _) = nodes(0), nodes(1)
    keys = chain(8)
    write(a, sa, keys, turns=((0, 8),))
    with pytest.raises(ConfigError, match="node=0 is already in the cluster"):
        nodes(0)
    a.close()
    assert b.lookup("", keys) is None
    a.close()                                          # idempotent


def test_unreachable_directory(tmp_path, secret_file):  # noqa: F811
    cfg = config(f"redis://127.0.0.1:{free_port()}/0", 0, secret_file)
    with FlatCakeStore(tmp_path / "s", LAY, cfg) as st:
        with pytest.raises(DirectoryError, match="join failed"):
            ClusterNode(st, cfg)
        assert st.reclaimer.listeners == []


def test_directory_down_skips_lookups_for_a_while(nodes, redis_url):  # noqa: F811
    import redis
    b, _ = nodes(1)
    keys = chain(4)
    redis.Redis.from_url(redis_url).shutdown(nosave=True)
    t = time.monotonic()
    assert b.lookup("", keys) is None and b.lookup("", keys) is None
    assert time.monotonic() - t < 0.5 + SLACK
    assert b.stats()["directory_down"] == 1            # the second lookup did not try


@pytest.mark.parametrize("emulate", ["0", "1"], ids=["host", "emulated-device"])
def test_direct_flow_with_a_remote_tail_restores_and_counts_it(nodes, monkeypatch, emulate):
    """The server's path: ``DirectRestorer`` runs a flow whose tail another node holds
    (the stand-in scheduler's torch pool; ``emulated-device`` takes the GPU branch)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("sglang")
    from tests.support import standin
    from sglang_flatcake.read import device as dv
    from sglang_flatcake.sglang.hicache import direct as dr
    monkeypatch.setenv(dv.EMULATE_ENV, emulate)
    (a, sa), (b, sb) = nodes(0), nodes(1)
    keys = chain(N)
    data = write(a, sa, keys)
    sb.put(keys[:10], data[:10])
    sched, pool_, alloc, tree = standin.scheduler(torch, "mha", 4, 40 * 16, 2, 32,
                                                  torch.bfloat16, 16, "cpu", 16)
    backend = standin.backend(sb)
    backend.cluster = b
    r = dr.DirectRestorer(sched, backend)
    try:
        span = b.lookup("", keys[10:])
        flow = dr.Flow("a", "h", list(range(16 + N * 16)), keys, 16, (N - 10) * LAY.block_bytes,
                       0, chain=["p"] + keys, remote=span)
        assert r.allocate(flow)
        slots = flow.slots.clone()
        r.submit(flow)
        flow.future.result()
        assert r.local_result(flow) == (True, N)
        r.finish(flow, N)
        assert r.counters["restored_tokens"] == N * 16 and tree.locks == 0
        want = data.reshape(N, LAY.layers, 2, -1)
        k = pool_.k_buffer[3][slots[16 * 17:16 * 18]].contiguous().view(torch.uint8).numpy()
        assert np.array_equal(k.reshape(-1), want[17, 3, 0])          # page 17 came from node 0
    finally:
        r.close()


def test_remote_span_stops_at_this_nodes_own_entries():
    from sglang_flatcake.cluster.directory import Lookup
    from sglang_flatcake.cluster.span import remote_span
    keys = chain(6)
    found = Lookup(5, (2, 2, 3, 1, 2), {1: "tcp://me", 2: "tcp://two", 3: "tcp://three"})
    span = remote_span(found, "t", keys, me=1)
    assert span.keys == tuple(keys[:3]) and span.tenant == "t"
    assert span.runs == (("tcp://two", 0, 2), ("tcp://three", 2, 1))
    assert remote_span(Lookup(2, (1, 2), {1: "a", 2: "b"}), "", keys, me=1) is None
    assert remote_span(Lookup(0, (), {}), "", keys, me=1) is None
