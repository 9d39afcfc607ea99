"""The signal hooks, driven the way SGLang's scheduler calls them (fakes for the tree)."""

from types import SimpleNamespace

from sglang_flatcake.sglang import signals
from sglang_flatcake.sglang.signals import BOARD


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


def cache(core, session=None):
    return SimpleNamespace(tree_core=core, insert_session_id=session,
                           cache_controller=SimpleNamespace(storage_backend_type="flatcake"))


def backup(c, node_id, keys):
    """SGLang's order: the insert's backup action, then write_backup_storage -> write_storage."""
    signals._execute_backup_around(lambda cache, action: None, c, SimpleNamespace(node_ids=[node_id]))

    def write_backup_storage(cache, nid):
        signals._write_storage_around(lambda ctl, hi, tok, hv: 7, None, "hi", "tok", keys)
    signals._write_backup_storage_around(write_backup_storage, c, node_id)


def test_rust_core_path_info_reaches_the_board():
    backup(cache(Core(path_start=320, children=3), session="s-1"), 11, ["k1", "k2"])
    seen = BOARD.lookup("k2")
    assert seen.context_tokens == 320 and seen.refcount == 3 and seen.session_id == "s-1"
    assert seen.tenant == ""                      # no cache_salt


def test_the_nodes_cache_salt_is_its_tenant():
    backup(cache(Core(path_start=0, children=1, salt="team-a")), 15, ["k5"])
    assert BOARD.lookup("k5").tenant == "team-a"


def test_python_core_lock_ref_wins_when_larger():
    backup(cache(Core(path_start=0, children=1, lock_ref=5)), 12, ["k3"])
    assert BOARD.lookup("k3").refcount == 5 and BOARD.lookup("k3").session_id is None


def test_other_backends_post_nothing():
    c = cache(Core(64, 2))
    c.cache_controller.storage_backend_type = "file"
    backup(c, 13, ["k4"])
    assert BOARD.lookup("k4") is None


def test_a_failing_tree_never_breaks_the_backup():
    class Broken(Core):
        def collect_path_info(self, ids):
            raise RuntimeError("tree moved")
    calls = []
    signals._write_backup_storage_around(lambda c, n: calls.append(n), cache(Broken(0, 0)), 14)
    assert calls == [14]


def test_batches_of_one_operation_share_state():
    assert BOARD.op_state() is None
    seen = []
    signals._page_backup_around(lambda ctl, op: seen.append(BOARD.op_state()), None, object())
    assert seen == [{}] and BOARD.op_state() is None
