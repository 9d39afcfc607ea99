"""FlatCakeStorage through SGLang's own HiCacheStorageConfig and v1 calls, on CPU tensors."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
hs = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from tests.support import chain  # noqa: E402
from sglang_flatcake.errors import ConfigError  # noqa: E402
from sglang_flatcake.sglang.hicache.backend import FlatCakeStorage  # noqa: E402
from sglang_flatcake.sglang.rank_store import rank_dir  # noqa: E402
from sglang_flatcake.sglang.plugin import merged_extra_config  # noqa: E402

L, H, D, PS, PAGES = 2, 2, 8, 4, 32


def host_pool(layout="page_first_direct", mla=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    if mla:
        kv = torch.randn((PAGES, L, PS, 1, 16), generator=g).to(torch.bfloat16)
        return SimpleNamespace(kv_buffer=kv, layout=layout, page_size=PS, layer_num=L)
    k = torch.randn((PAGES, L, PS, H, D), generator=g).to(torch.bfloat16)
    v = torch.randn((PAGES, L, PS, H, D), generator=g).to(torch.bfloat16)
    return SimpleNamespace(k_buffer=k, v_buffer=v, layout=layout, page_size=PS, layer_num=L)


def storage_config(tmp_path, tp_rank=0, tp_size=1, mla=False, **extra):
    return hs.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="tiny/llama", extra_config={"store_dir": str(tmp_path), "memory_bytes": "1MiB",
                                               **extra})


def token_indices(pages):
    return torch.tensor([p * PS + o for p in pages for o in range(PS)])


def test_set_exists_get_round_trip_and_restart(tmp_path):
    pool = host_pool()
    keys = chain(5, "b")
    be = FlatCakeStorage(storage_config(tmp_path), pool)
    prefix = hs.HiCacheStorageExtraInfo(prefix_keys=[])
    assert be.batch_set_v1(keys, token_indices([3, 7, 9, 10, 11]), prefix) == [True] * 5
    assert be.batch_exists(keys) == 5 and be.batch_exists(chain(2, "nope")) == 0
    dst = host_pool(seed=1)
    be2 = FlatCakeStorage(storage_config(tmp_path / "other"), dst)
    be.close()
    be = FlatCakeStorage(storage_config(tmp_path), dst)       # restart on the same store
    assert be.batch_exists(keys) == 5
    got = be.batch_get_v1(keys, token_indices([0, 1, 2, 4, 5]))
    assert got == [True] * 5
    for s, d in zip([3, 7, 9, 10, 11], [0, 1, 2, 4, 5]):
        assert torch.equal(dst.k_buffer[d], pool.k_buffer[s])
        assert torch.equal(dst.v_buffer[d], pool.v_buffer[s])
    st = be.get_stats().flatcake
    assert st["blocks_ssd"] + st["blocks_memory"] == 5 and st["read_commands"] >= 1
    be.close()
    be2.close()


def test_prefix_keys_continue_the_session(tmp_path):
    pool = host_pool()
    keys = chain(8, "p")
    be = FlatCakeStorage(storage_config(tmp_path), pool)
    be.batch_set_v1(keys[:4], token_indices(range(4)), hs.HiCacheStorageExtraInfo(prefix_keys=[]))
    be.batch_set_v1(keys[4:], token_indices(range(4, 8)),
                    hs.HiCacheStorageExtraInfo(prefix_keys=keys[:4]))
    assert len(be.store.sessions) == 1
    assert be.store.lineage(keys[-1]).writes == 2
    be.close()


def test_tp_ranks_own_separate_directories(tmp_path):
    dirs = {rank_dir(str(tmp_path), storage_config(tmp_path, tp_rank=r, tp_size=2)) for r in range(2)}
    assert len(dirs) == 2
    a = FlatCakeStorage(storage_config(tmp_path, 0, 2), host_pool())
    b = FlatCakeStorage(storage_config(tmp_path, 1, 2), host_pool())   # no lock conflict
    assert a.dir != b.dir
    a.close()
    b.close()


def test_mla_pool_round_trip(tmp_path):
    pool = host_pool(mla=True)
    keys = chain(3, "mla")
    be = FlatCakeStorage(storage_config(tmp_path, mla=True), pool)
    assert be.store.layout.kind == "mla"
    be.batch_set_v1(keys, token_indices([5, 6, 7]), hs.HiCacheStorageExtraInfo(prefix_keys=[]))
    dst = host_pool(mla=True, seed=3)
    be.close()
    be = FlatCakeStorage(storage_config(tmp_path, mla=True), dst)
    assert be.batch_get_v1(keys, token_indices([0, 1, 2])) == [True] * 3
    assert torch.equal(dst.kv_buffer[0:3], pool.kv_buffer[5:8])
    be.close()


def test_mla_with_tp_is_refused_clearly(tmp_path):
    with pytest.raises(ConfigError, match="MLA models with --tp-size > 1"):
        FlatCakeStorage(storage_config(tmp_path, 0, 2, mla=True), host_pool(mla=True))


def test_bad_extra_config_value_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--flatcake-high-watermark"):
        FlatCakeStorage(storage_config(tmp_path, high_watermark=3), host_pool())


def test_merged_extra_config(tmp_path):
    out = json.loads(merged_extra_config("flatcake", '{"prefetch_threshold": 64}',
                                         {"memory_bytes": "2GiB", "store_dir": str(tmp_path)}))
    assert out == {"prefetch_threshold": 64, "memory_bytes": "2GiB", "store_dir": str(tmp_path),
                   "hicache_storage_pass_prefix_keys": True}
    with pytest.raises(ConfigError, match="--flatcake-io-engine"):
        merged_extra_config("flatcake", None, {"io_engine": "spdk"})
    with pytest.raises(ConfigError, match="not flatcake"):
        merged_extra_config("file", None, {"memory_bytes": "1GiB"})
    assert merged_extra_config("file", '{"a": 1}', {}) == '{"a": 1}'


def test_the_launcher_hands_the_model_to_each_ranks_store(tmp_path, caplog):
    """HiCache mode: the launcher adds the model path and revision to the extra config; the
    backend takes them as what its store caches KV for, not as unknown keys."""
    from sglang_flatcake.sglang.hicache.backend import config_from_extra
    out = json.loads(merged_extra_config("flatcake", None, {"store_dir": str(tmp_path)},
                                         ("/models/m", "r1")))
    assert (out["model_path"], out["model_revision"]) == ("/models/m", "r1")
    with caplog.at_level("WARNING", logger="sglang_flatcake"):
        _, rest = config_from_extra(out)
    assert rest["model_path"] == "/models/m" and "model_path" not in caplog.text
    b = FlatCakeStorage(storage_config(tmp_path, model_path="/models/m", model_revision="r1"))
    assert b.model == ("/models/m", "r1")


def test_unwritable_store_dir_stops_the_launch_naming_the_path(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    bad = blocker / "store"
    with pytest.raises(ConfigError, match=f"--flatcake-store-dir='{bad}' cannot be written"):
        merged_extra_config("flatcake", None, {"store_dir": str(bad)})
    with pytest.raises(ConfigError, match=f"--flatcake-store-dir='{bad}' cannot be written"):
        FlatCakeStorage(storage_config(bad), host_pool())
    assert blocker.read_text() == "not a folder"


def test_each_rank_gets_its_own_ssd_region(tmp_path):
    from sglang_flatcake.errors import ConfigError
    from sglang_flatcake.sglang.rank_store import rank_ssd_path
    two = [storage_config(tmp_path, tp_rank=r, tp_size=2) for r in range(2)]
    assert [rank_ssd_path(str(tmp_path / "r{rank}.img"), c) for c in two] == \
        [str(tmp_path / "r0.img"), str(tmp_path / "r1.img")]
    assert [rank_ssd_path("/a.img, /b.img", c) for c in two] == ["/a.img", "/b.img"]
    with pytest.raises(ConfigError, match="one region for 2 ranks"):
        rank_ssd_path("/a.img", two[0])
    with pytest.raises(ConfigError, match="lists 3 paths for 2 ranks"):
        rank_ssd_path("/a,/b,/c", two[1])
    # two ranks, each on its own pre-sized file, open side by side
    stores = [FlatCakeStorage(storage_config(tmp_path, r, 2, ssd_path=str(tmp_path / "r{rank}.img"),
                                             ssd_bytes="64MiB"), host_pool()) for r in range(2)]
    assert {s.config.ssd_path for s in stores} == {str(tmp_path / "r0.img"), str(tmp_path / "r1.img")}
    keys = chain(3, "r")
    for s in stores:
        s.batch_set_v1(keys, token_indices([0, 1, 2]))
        assert s.batch_exists(keys) == 3
        s.close()


def test_write_once_skips_only_nodes_whose_pages_are_all_stored(tmp_path):
    be = FlatCakeStorage(storage_config(tmp_path), host_pool())
    keys = chain(4, "w")
    be.batch_set_v1(keys[:3], token_indices([0, 1, 2]), hs.HiCacheStorageExtraInfo(prefix_keys=[]))
    nodes = {1: keys[:3], 2: keys[1:3], 3: keys[2:4], 4: None}   # node 3 has an unstored page

    class Core:
        def build_storage_backup_spec(self, node_id, pass_prefix_keys):
            hv = nodes[node_id]
            return None if hv is None else SimpleNamespace(hash_value=hv)

    cache = SimpleNamespace(tree_core=Core(), page_size=PS, tp_world_size=1, pp_size=1)
    assert [be.write_once.skip(cache, n, be.store) for n in (1, 2, 3, 4)] == \
        [True, True, False, False]
    assert be.get_stats().flatcake["write_once"] == {"storage_backups_skipped": 2,
                                                     "tokens_not_rewritten": 5 * PS}
    be.close()


def test_cluster_with_tp_is_refused_without_the_redis_password(tmp_path):
    """The refusal names the directory URL with its password masked (issue 32: a password
    in an error text lands in logs)."""
    url = "redis://flatcake:hunter2-secret@127.0.0.1:6379"
    with pytest.raises(ConfigError, match="one rank") as e:
        FlatCakeStorage(storage_config(tmp_path, 0, 2, cluster_directory=url), host_pool())
    assert "hunter2-secret" not in str(e.value) and "flatcake:***@127.0.0.1" in str(e.value)


@pytest.mark.parametrize("nice", [19, 0])
def test_the_storage_backup_thread_writes_at_the_writer_nice(tmp_path, nice):
    """SGLang calls ``batch_set_v1`` from its storage-backup thread: that thread lowers itself
    to ``writer_nice`` (0: left alone); a call on the main thread never lowers it."""
    import os
    import threading
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base >= 19:
        pytest.skip("this process already runs at nice 19: nothing to lower")
    be = FlatCakeStorage(storage_config(tmp_path, writer_nice=nice), host_pool())
    try:
        info = hs.HiCacheStorageExtraInfo(prefix_keys=[])
        assert be.batch_set_v1(chain(2, "m"), token_indices([0, 1]), info) == [True] * 2
        assert os.getpriority(os.PRIO_PROCESS, 0) == base
        out = {}

        def backup():
            out["ok"] = be.batch_set_v1(chain(2, "n"), token_indices([2, 3]), info)
            out["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        t = threading.Thread(target=backup)
        t.start()
        t.join(60)
        assert out["ok"] == [True] * 2
        assert out["nice"] == (max(base, nice) if nice else base)
    finally:
        be.close()


def test_the_storage_backup_thread_writes_between_forwards(tmp_path):
    """``batch_set_v1`` on SGLang's backup thread waits while the scheduler runs a forward (the
    ``_get_new_batch_prefill_raw`` hook steps ``backend.quiet`` as each step starts) and
    writes once its loop spins again; a call on the main thread never waits."""
    import threading
    import time
    from sglang_flatcake.sglang.hicache.scheduling import _prefill_before
    be = FlatCakeStorage(storage_config(tmp_path), host_pool())
    controller = SimpleNamespace(storage_backend_type="flatcake", storage_backend=be)
    scheduler = SimpleNamespace(tree_cache=SimpleNamespace(cache_controller=controller))
    try:
        info = hs.HiCacheStorageExtraInfo(prefix_keys=[])
        be.quiet.asleep_s = 60.0              # no step for a while reads as "a long forward"
        be.quiet.max_wait_s = 60.0            # ... and never runs out (CI can be slow)
        _prefill_before(scheduler)            # a step starts ... and runs a forward
        time.sleep(0.01)
        assert be.batch_set_v1(chain(1, "q0"), token_indices([0]), info) == [True]  # main
        keys, out = chain(2, "q"), {}
        t = threading.Thread(target=lambda: out.update(
            ok=be.batch_set_v1(keys, token_indices([2, 3]), info)))
        t.start()
        time.sleep(0.3)
        assert "ok" not in out and be.batch_exists(keys) == 0
        deadline = time.monotonic() + 30
        while t.is_alive():                    # the loop spins: the write goes
            assert time.monotonic() < deadline, "the write never went"
            _prefill_before(scheduler)
            time.sleep(0.0002)
        assert out["ok"] == [True] * 2 and be.batch_exists(keys) == 2
        q = be.get_stats().flatcake["quiet"]
        assert q["waits"] == 1 and q["wait_ms"] >= 250 and q["waits_run_out"] == 0
    finally:
        be.close()
