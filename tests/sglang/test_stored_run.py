"""The leading stored run of a chain (``sglang/stored_run.py``) and the write-once decision
built on it (``sglang/write_once.py``): both modes skip what the store holds."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_flatcake import address as addr
from sglang_flatcake.sglang.stored_run import StoredRun, stored_run
from sglang_flatcake.sglang.write_once import WriteOnce

MEM, SSD = SimpleNamespace(medium=addr.Medium.MEMORY), SimpleNamespace(medium=addr.Medium.SSD)


class Store:
    def __init__(self, where: dict) -> None:
        self.where = where

    def locate(self, keys):
        return [self.where.get(k) for k in keys]


def test_the_run_stops_at_the_first_miss_or_damaged_key_and_marks_ssd_pages():
    store = Store({"a": MEM, "b": MEM, "c": SSD, "d": MEM, "f": SSD})
    assert stored_run(store, list("abcdef")) == StoredRun(4, (2,))
    assert stored_run(store, list("abcdef")).lead_memory == 2
    assert stored_run(store, list("abcdef"), damaged={"c"}) == StoredRun(2, ())
    assert stored_run(store, list("abcdef"), damaged={"c"}).lead_memory == 2
    assert stored_run(store, list("xa")) == StoredRun(0, ()) and stored_run(store, []).pages == 0


def cache(keys):
    spec = SimpleNamespace(hash_value=keys)
    core = SimpleNamespace(build_storage_backup_spec=lambda node_id, _: spec)
    return SimpleNamespace(tree_core=core, tp_world_size=1, pp_size=1, page_size=16)


def test_write_once_skips_a_node_only_when_every_page_is_stored():
    once, store = WriteOnce(), Store({"a": MEM, "b": SSD})
    assert once.skip(cache(["a", "b"]), 1, store)
    assert not once.skip(cache(["a", "b", "c"]), 2, store)
    assert not once.skip(cache([]), 3, store)                  # nothing to back up: no skip
    assert once.counters.snapshot() == {"storage_backups_skipped": 1, "tokens_not_rewritten": 32}
