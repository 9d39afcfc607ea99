"""Two queues' disk-sharing gate: a restore starts beside one in flight only when it is shorter
than what that one has left (``TwoQueuePolicy.share_shorter``)."""

from sglang_flatcake.sched.queues import TwoQueuePolicy

GB = 10**9


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_restore_as_long_as_the_one_in_flight_waits_for_it():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=100 * GB, restore_bytes_per_s=GB)
    q.arrive("a", 0, 4 * GB)
    q.arrive("b", 1, 4 * GB)
    assert q.start_prefetches() == ["a"]                # b would halve a's bandwidth
    c.t = 1.0
    assert q.start_prefetches() == []                   # a has 3 s left, b needs 4 s
    c.t = 4.0
    q.prefetch_done("a")
    assert q.start_prefetches() == ["b"]


def test_a_shorter_restore_starts_beside_a_long_one_until_the_long_one_nears_its_end():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=100 * GB, restore_bytes_per_s=GB)
    q.arrive("big", 0, 8 * GB)
    assert q.start_prefetches() == ["big"]
    c.t = 1.0
    q.arrive("small", 1, 2 * GB)                        # 2 s < 7 s left: shortest first
    assert q.start_prefetches() == ["small"]
    c.t = 6.0
    q.arrive("late", 2, 2 * GB)                         # big has 2 s left by its rate: waits
    assert q.start_prefetches() == []
    assert q.waiting() == {"ready": 0, "preparing": 1, "prefetching": 2}


def test_off_restores_share_the_disk_whenever_budget_allows():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=100 * GB, restore_bytes_per_s=GB, share_shorter=False)
    q.arrive("a", 0, 4 * GB)
    q.arrive("b", 1, 4 * GB)
    assert q.start_prefetches() == ["a", "b"]
