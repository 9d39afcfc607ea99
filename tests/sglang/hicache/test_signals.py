"""The signal hooks, driven the way SGLang's scheduler calls them (fakes for the tree)."""

from types import SimpleNamespace

import threading

from sglang_flatcake.sglang.hicache import signals
from sglang_flatcake.sglang.hicache.signals import Counters, SignalBoard


class Core:
    def __init__(self, path_start, children, lock_ref=None, salt=None):
        self.info = SimpleNamespace(path_start=path_start, num_children=children)
        self.lock_ref, self.salt = lock_ref, salt

    def prefetch_anchor_info(self, nid):          # both SGLang tree cores have it
        return None, self.salt

    def collect_path_info(self, ids):
        return [[SimpleNamespace(path_start=0, num_children=1), self.info]]

    def node_by_id(self, nid):
        if self.lock_ref is None:
            raise NotImplementedError("rust core")
        return SimpleNamespace(component_data=[SimpleNamespace(lock_ref=self.lock_ref)])


def fake_backend():
    """What the hooks read of ``FlatCakeStorage``: its own board, no store yet."""
    return SimpleNamespace(board=SignalBoard(), store=None)


def cache(core, session=None, backend=None):
    """The UnifiedRadixCache members the hooks read (``hooks.MEMBERS``)."""
    ctl = SimpleNamespace(storage_backend_type="flatcake",
                          storage_backend=backend or fake_backend())
    return SimpleNamespace(tree_core=core, insert_session_id=session, cache_controller=ctl,
                           enable_storage=True)


def backup(c, node_id, keys):
    """SGLang's order: the insert's backup action, then write_backup_storage -> write_storage."""
    signals._execute_backup_around(lambda cache, action: None, c, SimpleNamespace(node_ids=[node_id]))

    def write_backup_storage(cache, nid):
        signals._write_storage_around(lambda ctl, hi, tok, hv: 7, c.cache_controller,
                                      "hi", "tok", keys)
    signals._write_backup_storage_around(write_backup_storage, c, node_id)
    return c.cache_controller.storage_backend.board


def test_rust_core_path_info_reaches_the_board():
    board = backup(cache(Core(path_start=320, children=3), session="s-1"), 11, ["k1", "k2"])
    seen = board.lookup("k2")
    assert seen.context_tokens == 320 and seen.refcount == 3 and seen.session_id == "s-1"
    assert seen.tenant == ""                      # no cache_salt


def test_the_nodes_cache_salt_is_its_tenant():
    board = backup(cache(Core(path_start=0, children=1, salt="team-a")), 15, ["k5"])
    assert board.lookup("k5").tenant == "team-a"


def test_python_core_lock_ref_wins_when_larger():
    board = backup(cache(Core(path_start=0, children=1, lock_ref=5)), 12, ["k3"])
    assert board.lookup("k3").refcount == 5 and board.lookup("k3").session_id is None


def test_other_backends_post_nothing():
    c = cache(Core(64, 2), session="s-2")
    c.cache_controller.storage_backend_type = "file"
    board = backup(c, 13, ["k4"])
    assert board.lookup("k4") is None and board.take_session(13) is None


def test_a_failing_tree_never_breaks_the_backup():
    class Broken(Core):
        def collect_path_info(self, ids):
            raise RuntimeError("tree moved")
    calls = []
    c = cache(Broken(0, 0))
    signals._write_backup_storage_around(lambda c, n: calls.append(n), c, 14)
    signals._write_backup_storage_around(lambda c, n: calls.append(n), c, 16)
    assert calls == [14, 16]
    assert c.cache_controller.storage_backend.board.stats()["failures"] == 2   # counted


def test_batches_of_one_operation_share_state():
    ctl = cache(Core(0, 1)).cache_controller
    board = ctl.storage_backend.board
    assert board.thread.op is None
    seen = []
    signals._page_backup_around(lambda ctl, op: seen.append(board.thread.op), ctl, object())
    assert seen == [{}] and board.thread.op is None


def test_two_backends_in_one_process_share_no_signals():
    """Each backend has its own board: what one tree posts, the other never sees (the old
    process-wide ``BOARD`` gave both the same map, sessions and counters)."""
    a, b = fake_backend(), fake_backend()
    backup(cache(Core(64, 4), session="s-a", backend=a), 21, ["shared-key"])
    assert a.board.lookup("shared-key").session_id == "s-a"
    assert b.board.lookup("shared-key") is None
    a.board.note_read(SimpleNamespace(hits=3))
    assert a.board.stats()["hit_blocks"] == 3 and b.board.stats()["hit_blocks"] == 0


def test_counters_lose_no_increment_across_threads():
    c = Counters("n")
    threads = [threading.Thread(target=lambda: [c.add("n") for _ in range(20_000)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c["n"] == 80_000
