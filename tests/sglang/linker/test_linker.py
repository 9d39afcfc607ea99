"""``FlatCakeLinker`` through SGLang's linker contract, without a server.

The linker is built as SGLang builds it (``Linker(server_args, params, components=...,
extra_config=..., forward_stream=...)``) over a CPU MHA pool; each test drives the calls
the tree makes (``offload`` + completions, ``lookup``, ``load``, ``start_layer_wise_loading``,
the forward's ``wait_until``, ``finish_layer_wise_loading``) and checks the KV in the slots.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.unified_cache.unified_cache_linker")

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402

from sglang_flatcake.address import Medium  # noqa: E402
from sglang_flatcake.errors import ConfigError  # noqa: E402
from sglang_flatcake.sglang.linker import FlatCakeLinker  # noqa: E402

from tests.support import chain, extend  # noqa: E402
from tests.support.request_rows import held_rows  # noqa: E402

PAGE, LAYERS, HEADS, DIM, SLOTS = 4, 3, 2, 8, 512


ARGS = SimpleNamespace(model_path="tiny", served_model_name=None, revision=None,
                       enable_metrics=False)   # the ServerArgs fields read


class Server:
    """A CPU MHA pool, its request rows, and one linker over them."""

    def __init__(self, store_dir, **extra) -> None:
        self.k = [torch.zeros(SLOTS, HEADS, DIM) for _ in range(LAYERS)]
        self.v = [torch.zeros(SLOTS, HEADS, DIM) for _ in range(LAYERS)]
        kv = SimpleNamespace(k_buffer=self.k, v_buffer=self.v)
        self.row_pool = held_rows(4, 256)    # SGLang's own ReqToTokenPool, every row held
        self.rows = self.row_pool.req_to_token
        self.params = CacheInitParams(       # SGLang's own, with its defaults
            disable=False, token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: kv),
            page_size=PAGE, req_to_token_pool=self.row_pool)
        cfg = {"store_dir": str(store_dir), "durable": False, "io_engine": "posix",
               "memory_bytes": "1MiB", "ssd_bytes": "64MiB", "extent_bytes": "64KiB", **extra}
        self.linker = FlatCakeLinker(ARGS, self.params,
                                     components={ComponentType.FULL}, extra_config=cfg)

    def fill(self, slots, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for b in self.k + self.v:
            b[slots] = torch.randn(len(slots), HEADS, DIM, generator=g)

    def kv(self, slots) -> torch.Tensor:
        return torch.stack([b[slots] for b in self.k + self.v])

    def offload(self, keys, slots, session_id=None) -> bool:
        before = self.linker.num_completed_offloads()
        assert self.linker.offload([PoolTransfer(PoolName.KV, device_indices=slots, keys=keys)],
                                   session_id=session_id)
        deadline = time.monotonic() + 30
        while self.linker.num_completed_offloads() == before:   # an idle scheduler's steps:
            assert time.monotonic() < deadline, "offload did not complete"   # the writer's
            time.sleep(0.0002)                                   # quiet moment
        return self.linker.pop_completed_offload()

    def restore(self, keys, slots) -> bool:
        """The tree's calls for one request: load, start, the forward's layer waits, finish."""
        assert self.linker.load("r", [PoolTransfer(PoolName.KV, device_indices=slots, keys=keys)])
        index = self.linker.start_layer_wise_loading()
        counter = self.linker.layer_done_counter
        counter.set_consumer(index)
        self.landed_at_wait = []
        for layer in range(LAYERS):
            counter.wait_until(layer)     # the forward's wait, as the pool's get_key_buffer does
            self.landed_at_wait.append(self.layer_kv(layer, slots))
        return self.linker.finish_layer_wise_loading(index)

    def layer_kv(self, layer, slots) -> torch.Tensor:
        return torch.stack([self.k[layer][slots], self.v[layer][slots]]).clone()

    def lookup(self, keys) -> int:
        got = self.linker.lookup("r", [PoolTransfer(PoolName.KV, keys=keys)])
        assert got == list(range(1, len(got) + 1))
        probe = self.linker.finder.probe         # a disk probe the lookup started pins the
        if probe is not None and probe.pending is not None:     # pages it reads: let it end
            probe.pending.result(timeout=30)
        return len(got)


def slots(first_page: int, pages: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + pages) * PAGE, dtype=torch.int64)


@pytest.fixture(params=["host", "emulated"])
def server(tmp_path, request, monkeypatch):
    """``emulated``: the CPU pool served as device memory (``FLATCAKE_EMULATE_DEVICE``), so
    loads take the GPU's branch: a device window, checksum flags, scatter launches."""
    monkeypatch.setenv("FLATCAKE_EMULATE_DEVICE", "1" if request.param == "emulated" else "0")
    s = Server(tmp_path / "store")
    assert (s.linker.pool.device is None) == (request.param == "host")
    yield s
    s.linker.close()


def test_offloaded_pages_come_back_into_poisoned_slots_layer_by_layer(server):
    keys, src = chain(6, "p"), slots(1, 6)
    server.fill(src, 1)
    server.rows[0, :len(src)] = src.to(torch.int32)
    want = server.kv(src).clone()
    assert server.offload(keys, src)
    dst = slots(20, 6)
    for b in server.k + server.v:           # poisoned destination, and the source wiped
        b[dst] = float("nan")
        b[src] = 0
    assert server.lookup(keys) == 6
    assert server.restore(keys, dst)
    assert torch.equal(server.kv(dst), want)
    # each layer held its KV when the forward's wait for it returned
    for layer, got in enumerate(server.landed_at_wait):
        assert torch.equal(got, want[[layer, LAYERS + layer]])
    assert server.linker.stats()["load"]["pages_from_ssd"] == 6


def test_placement_signals_come_from_the_rows_and_the_stored_chain(server):
    """Turn 1 prompt, its reply, turn 2 prompt: the third write is a later turn after a
    short reply (context from its row), so it goes to memory; the first two to SSD."""
    prompt, reply, turn2 = chain(3, "t"), None, None
    reply = extend(prompt, 2, "r")
    turn2 = extend(reply, 2, "u")
    parts = [(prompt, slots(1, 3)), (reply, slots(4, 2)), (turn2, slots(6, 2))]
    row = torch.cat([s for _, s in parts])
    server.rows[1, :len(row)] = row.to(torch.int32)
    for i, (keys, sl) in enumerate(parts):
        server.fill(sl, 10 + i)
        assert server.offload(keys, sl)
    media = [[a.medium for a in server.linker.store.locate(k)] for k, _ in parts]
    assert media[0] == [Medium.SSD] * 3 and media[1] == [Medium.SSD] * 2
    assert media[2] == [Medium.MEMORY] * 2
    # the three writes are one session (the parent key continued it)
    assert len({server.linker.store.lineage(k[0]).session for k, _ in parts}) == 1
    # and a restore of the whole chain mixes memory and SSD pages correctly
    keys = prompt + reply + turn2
    want = server.kv(row).clone()
    dst = slots(40, 7)
    assert server.lookup(keys) == 7 and server.restore(keys, dst)
    assert torch.equal(server.kv(dst), want)
    load = server.linker.stats()["load"]
    assert load["pages_from_memory"] == 2 and load["pages_from_ssd"] == 5


def test_pages_the_store_holds_are_not_written_again(server):
    keys, src = chain(4, "w"), slots(1, 4)
    server.fill(src, 2)
    assert server.offload(keys, src)
    written = server.linker.store.stats()["ssd_blocks_written"]
    assert server.offload(keys, slots(30, 4))          # the tree offers loaded pages again
    assert server.linker.store.stats()["ssd_blocks_written"] == written
    assert server.linker.stats()["offload"]["pages_already_stored"] == 4


def flip_first_piece(store, keys) -> None:
    plan = store.plan(keys)
    cmd = plan.commands[int(plan.piece_cmd[0])]
    off = cmd.offset + int(plan.piece_offset[0]) + 7
    fd = os.open(cmd.path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, off)
        os.pwrite(fd, bytes([b[0] ^ 0xFF]), off)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_a_flipped_byte_fails_the_load_and_the_next_try_recomputes(server):
    keys, src = chain(5, "f"), slots(1, 5)
    server.fill(src, 3)
    assert server.offload(keys, src)
    flip_first_piece(server.linker.store, keys[2:])     # page 2, layer 0
    assert server.lookup(keys) == 5                      # not known to be damaged yet
    dst = slots(50, 5)
    assert server.restore(keys, dst) is False            # SGLang aborts the request
    assert server.linker.stats()["load"]["checksum_failures"] == 1
    # layer 0 never completed: the forward's wait returned on the failure, and the
    # damaged page never reached its slots
    assert not torch.equal(server.kv(dst[2 * PAGE:3 * PAGE]), server.kv(src[2 * PAGE:3 * PAGE]))
    assert server.lookup(keys) == 2                      # the next try stops before it
    assert server.restore(keys[:2], slots(60, 2))


def test_load_is_refused_when_the_store_lost_the_pages(server):
    keys, src = chain(3, "l"), slots(1, 3)
    server.fill(src, 4)
    assert server.offload(keys, src)
    assert server.lookup(keys) == 3
    server.linker.store.clear()
    t = PoolTransfer(PoolName.KV, device_indices=slots(70, 3), keys=keys)
    assert server.linker.load("r", [t]) is False          # SGLang recomputes, no error
    assert server.linker.start_layer_wise_loading() == -1


def test_a_cancelled_load_releases_its_pins(server):
    keys, src = chain(3, "c"), slots(1, 3)
    server.fill(src, 5)
    assert server.offload(keys, src)
    t = PoolTransfer(PoolName.KV, device_indices=slots(80, 3), keys=keys)
    assert server.linker.load("r", [t])
    assert server.linker.store.clear() == 0               # pinned by the queued load
    assert server.linker.cancel_queued_load("r")
    assert server.linker.store.clear() == 1
    st = server.linker.stats()                              # shown as loaded-but-unused
    assert (st["loads_cancelled"], st["load_tokens_cancelled"]) == (1, 3 * server.linker.pool.page)


def test_unsupported_components_are_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="SWA"):
        s = Server.__new__(Server)
        Server.__init__(s, tmp_path / "s")     # builds fine with FULL only
        s.linker.close()
        FlatCakeLinker(ARGS, s.params,
                       components={ComponentType.FULL, ComponentType.SWA},
                       extra_config={"store_dir": str(tmp_path / "t")})


def test_a_bad_extra_config_value_is_one_line_naming_it(tmp_path):
    with pytest.raises(ConfigError) as e:
        Server(tmp_path / "s", high_watermark=1.7)
    assert str(e.value).startswith("linker_extra_config.high_watermark=1.7 is not allowed")
    assert "\n" not in str(e.value)


def test_a_node_at_two_different_places_has_no_context_signal():
    from sglang_flatcake.sglang.linker.signals import find_in_rows
    rows = torch.zeros((3, 64), dtype=torch.int32)
    node = slots(5, 2)
    rows[0, 8:16] = node.to(torch.int32)
    rows[0, 4:8] = torch.arange(100, 104, dtype=torch.int32)
    w = find_in_rows(rows, node, PAGE)
    assert (w.context, w.parent_slot) == (8, 100)
    rows[1, 0:8] = node.to(torch.int32)           # the same slots at another place: unknown
    assert find_in_rows(rows, node, PAGE).context is None
    rows[1, 0:8] = 0
    rows[2, 12:16] = node[:4].to(torch.int32)      # a partial match does not count
    assert find_in_rows(rows, node, PAGE).context == 8


def test_only_rows_a_request_holds_are_searched():
    """A freed row still holds its old slots; SGLang's ``free_slots`` rules it out, so it
    neither hides a node's place (two places: no signal) nor is scanned at all."""
    from sglang_flatcake.sglang.linker.signals import find_in_rows, live_rows
    pool = held_rows(4, 64)
    rows, node = pool.req_to_token, slots(5, 2)
    rows[2, 8:16] = node.to(torch.int32)
    rows[2, 4:8] = torch.arange(100, 104, dtype=torch.int32)
    rows[3, 0:8] = node.to(torch.int32)            # row 3: a finished request's, not yet reused
    assert find_in_rows(rows, node, PAGE, live_rows(pool)).context is None   # both held
    pool.free_rows([3])
    assert live_rows(pool) == [0, 1, 2]
    w = find_in_rows(rows, node, PAGE, live_rows(pool))
    assert (w.context, w.parent_slot) == (8, 100)
    assert find_in_rows(rows, node, PAGE).context is None          # every row: ambiguous
    pool.free_rows([2])
    assert find_in_rows(rows, node, PAGE, live_rows(pool)).context is None
    assert find_in_rows(rows, node, PAGE, []).context is None


def test_the_offloader_searches_the_rows_the_pool_holds(server, monkeypatch):
    """The linker's offload reads SGLang's ``free_slots`` through ``live_rows``: a node whose
    only other copy is in a freed row gets its context signal from the held row."""
    from sglang_flatcake.sglang.linker import offload
    found = []
    real = offload.sig.find_in_rows
    monkeypatch.setattr(offload.sig, "find_in_rows",
                        lambda *a: found.append((a[3], real(*a))) or found[-1][1])
    keys, src = chain(2, "held"), slots(5, 2)
    server.rows[1, 8:16] = src.to(torch.int32)
    server.rows[3, 0:8] = src.to(torch.int32)
    server.row_pool.free_rows([3])
    assert server.offload(keys, src)
    ((searched, where),) = found
    assert searched == [0, 1, 2] and where.context == 8


def test_lookup_cuts_before_the_ssd_when_recomputing_is_faster(server):
    from sglang_flatcake.sched.rates import Rate
    keys, src = chain(4, "k"), slots(1, 4)
    server.fill(src, 6)
    assert server.offload(keys, src)                  # a first turn: on SSD
    assert server.lookup(keys) == 4                   # rates unknown: restore
    decider = server.linker.finder.decider
    decider.restore, decider.prefill = Rate(1.0), Rate(1e9)    # a slow disk, a fast GPU
    assert server.lookup(keys) == 0
    assert decider.counts["recomputed_requests"] == 1
    decider.restore, decider.prefill = Rate(1e12), Rate(1.0)   # the other way round
    assert server.lookup(keys) == 4


def test_the_workers_counters_are_read_under_their_owners_lock(server):
    """The loader and offloader threads add to their counters while ``stats`` (scheduler
    thread) reads them: both are ``Counters`` (each add and each snapshot under its lock),
    and ``stats`` gets a snapshot, every name there from the start."""
    from sglang_flatcake.sglang.counters import Counters
    lk = server.linker
    assert isinstance(lk.loader.counters, Counters)
    assert isinstance(lk.offloader.counters, Counters)
    st = lk.stats()
    assert st["offload"] == {"pages_already_stored": 0, "pages_written": 0, "pages_failed": 0,
                             "offloads_failed": 0, "pages_over_backlog": 0, "write_ms": 0}
    assert st["quiet"] == {"waits": 0, "wait_ms": 0, "waits_run_out": 0}
    st["load"]["batches"] += 5                          # a copy
    assert lk.stats()["load"]["batches"] == 0


class Gate:
    """A ready event the test opens: the offload worker waits on it, as on the forward's."""

    def __init__(self) -> None:
        import threading
        self.open = threading.Event()

    def synchronize(self) -> None:
        assert self.open.wait(30), "the gate was never opened"


def test_the_offload_backlog_is_bounded_and_completions_keep_their_order(server):
    """A node offloaded while the bound's worth of pages already waits is not stored: it
    completes False in its turn without being read; the one before it is written; once the
    backlog drains a node is stored again."""
    from sglang_flatcake.sglang.linker.offload import Offloader
    from sglang_flatcake.sglang.linker.signals import SlotKeys
    lk = server.linker
    off = Offloader(lk.store, lk.pool, server.rows, SlotKeys(), max_backlog_bytes=1)
    try:
        a, b, c = chain(4, "ba"), chain(3, "bb"), chain(2, "bc")
        for i, k in enumerate((a, b, c)):
            server.fill(slots(60 + 8 * i, len(k)), 30 + i)
        gate = Gate()
        off.submit(a, slots(60, 4), [gate], None)        # held by the gate: the backlog is full
        assert off.backlog_bytes() == 4 * lk.store.layout.block_bytes
        off.submit(b, slots(68, 3), [], None)            # past the bound
        gate.open.set()
        off.drain()
        assert [off.pop_completed(), off.pop_completed()] == [True, False]
        assert off.counters.snapshot()["pages_over_backlog"] == 3
        assert off.backlog_bytes() == 0
        assert lk.store.exists(a) == 4 and lk.store.exists(b) == 0
        off.submit(c, slots(76, 2), [], None)            # drained: stored again
        off.drain()
        assert off.pop_completed() is True and lk.store.exists(c) == 2
    finally:
        off.close()


def test_a_write_waits_while_the_scheduler_runs_a_forward(server):
    """The worker shares the forward's GIL: a node offloaded as a step starts a forward is
    written only once the scheduler's loop spins again (steps microseconds apart); the wait is
    counted.  A ``/flush_cache`` (``reset``) drains the rest at once, forward or not."""
    lk = server.linker
    lk.quiet.asleep_s = 60.0                # no step for a while reads as "a long forward" here
    lk.quiet.max_wait_s = 60.0              # ... and never runs out (CI can be slow)
    a, b = chain(3, "qa"), chain(2, "qb")
    server.fill(slots(90, 3), 41)
    server.fill(slots(94, 2), 42)
    lk.num_completed_offloads()                   # a step starts ...
    time.sleep(0.01)                              # ... and runs a forward
    assert lk.offload([PoolTransfer(PoolName.KV, device_indices=slots(90, 3), keys=a)])
    time.sleep(0.3)
    assert lk.store.exists(a) == 0 and lk.num_completed_offloads() == 0   # a step, 0.3 s later
    deadline = time.monotonic() + 30
    while lk.num_completed_offloads() == 0:       # the loop spins: the write goes
        assert time.monotonic() < deadline, "the write never went"
        time.sleep(0.0002)
    assert lk.pop_completed_offload() is True and lk.store.exists(a) == 3
    st = lk.stats()["quiet"]
    assert st["waits"] == 1 and st["wait_ms"] >= 250 and st["waits_run_out"] == 0
    lk.num_completed_offloads()
    time.sleep(0.01)                              # another forward
    assert lk.offload([PoolTransfer(PoolName.KV, device_indices=slots(94, 2), keys=b)])
    time.sleep(0.05)
    t0 = time.monotonic()
    lk.reset()                                    # drains: written without waiting (its
    assert lk.store.exists(b) == 2                # quiet wait would run 60 s, then write)
    assert time.monotonic() - t0 < 1.5 and lk.stats()["quiet"]["waits_run_out"] == 0


def test_stored_pages_offered_during_a_forward_wait_for_nothing(server):
    """After ``/flush_cache`` the tree offers every node again: pages the store holds
    complete at once, forward or not (no quiet wait, nothing written)."""
    lk = server.linker
    keys, src = chain(3, "qs"), slots(100, 3)
    server.fill(src, 43)
    assert server.offload(keys, src)
    lk.quiet.asleep_s = lk.quiet.max_wait_s = 60.0     # a forward that would not end
    lk.num_completed_offloads()                        # a step starts a forward
    time.sleep(0.01)
    assert lk.offload([PoolTransfer(PoolName.KV, device_indices=slots(110, 3), keys=keys)])
    deadline = time.monotonic() + 10
    while lk.offloader.num_completed() == 0:           # (no scheduler step: still busy)
        assert time.monotonic() < deadline, "a stored node waited for a quiet moment"
        time.sleep(0.001)
    assert lk.pop_completed_offload() is True
    assert lk.stats()["quiet"]["waits"] == 0 and lk.stats()["quiet"]["waits_run_out"] == 0


def test_the_offload_worker_runs_at_the_writer_nice(server):
    """The worker lowers its own priority (``writer_nice``, 19 by default); the scheduler's
    thread keeps its own."""
    if os.getpriority(os.PRIO_PROCESS, 0) >= 19:
        pytest.skip("this process already runs at nice 19: nothing to lower")
    lk = server.linker
    tid = lk.offloader.thread.native_id
    deadline = time.monotonic() + 10
    while os.getpriority(os.PRIO_PROCESS, tid) < 19 and time.monotonic() < deadline:
        time.sleep(0.01)                                 # the worker sets it as it starts
    assert os.getpriority(os.PRIO_PROCESS, tid) == 19
    assert os.getpriority(os.PRIO_PROCESS, 0) < 19
