"""Two queues run one prefetch at a time (``TwoQueuePolicy.serial``): a second restore beside
one in flight would only split the disk's bandwidth."""

from sglang_flatcake.sched.queues import TwoQueuePolicy

GB = 10**9


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_second_restore_waits_for_the_one_in_flight():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=100 * GB, restore_bytes_per_s=GB)
    q.arrive("a", 0, 4 * GB)
    q.arrive("b", 1, 4 * GB)
    assert q.start_prefetches() == ["a"]                # b would halve a's bandwidth
    c.t = 1.0
    assert q.start_prefetches() == []
    assert q.waiting() == {"ready": 0, "preparing": 1, "prefetching": 1}
    c.t = 4.0
    q.prefetch_done("a")
    assert q.start_prefetches() == ["b"]


def test_a_declined_prefetch_frees_the_disk_for_the_next():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=100 * GB, restore_bytes_per_s=GB)
    q.arrive("big", 0, 8 * GB)
    q.arrive("small", 1, GB)                            # deadline 1.5 s < 4 s: goes first
    assert q.start_prefetches() == ["small"]
    q.declined("small")
    assert q.start_prefetches() == ["big"]


def test_off_restores_share_the_disk_whenever_budget_allows():
    c = Clock()
    q = TwoQueuePolicy(c, budget_bytes=100 * GB, restore_bytes_per_s=GB, serial=False)
    q.arrive("a", 0, 4 * GB)
    q.arrive("b", 1, 4 * GB)
    assert q.start_prefetches() == ["a", "b"]
