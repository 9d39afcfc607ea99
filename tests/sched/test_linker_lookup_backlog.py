"""Restore or recompute in linker mode (``sglang.linker.lookup.Lookup``): the backlog counts.

The linker used to price a request's SSD pages against a prefill backlog of 0 and restores
ahead without their latency, so under load it recomputed into a prefill queue it never
priced.  A fake store (``locate`` and ``layout`` only) and fitted rates; no server.
"""

from types import SimpleNamespace

from sglang_flatcake import address as addr
from sglang_flatcake.sglang.linker.lookup import Lookup

MIB = 1 << 20
PAGE = 16


def lookup(pages_on_ssd=8, block_bytes=4 * MIB):
    """A ``Lookup`` over ``pages_on_ssd`` SSD pages whose restore cost is fitted as 0.05 s
    + 100 MiB/s (three restores of different sizes) and prefill at 1,000 tokens/s."""
    where = [addr.Address(addr.Medium.SSD, 0, i * block_bytes) for i in range(pages_on_ssd)]
    store = SimpleNamespace(locate=lambda keys: where[:len(keys)],
                            layout=SimpleNamespace(page_tokens=PAGE, block_bytes=block_bytes))
    lk = Lookup(store, damaged=set(), enabled=True)
    for mib in (1, 4, 16):
        lk.decider.restore.observe(mib * MIB, 0.05 + mib / 100)
    lk.decider.prefill.observe(1000.0 * 10, 10.0)
    return lk, [f"k{i}" for i in range(pages_on_ssd)]


def test_restores_are_priced_as_latency_plus_bandwidth():
    lk, _ = lookup()
    assert abs(lk.decider.restore.latency - 0.05) < 1e-6
    assert abs(lk.decider.restore.value - 100 * MIB) < 1e-3 * MIB


def test_a_prefill_backlog_it_would_join_makes_it_restore():
    """32 MiB (0.37 s) against 128 tokens (0.128 s): alone it recomputes; behind 2,000
    prefill tokens (2 s) restoring ends sooner.  Fails on the old lookup, which priced
    every recompute against an empty prefill queue (and took no backlog)."""
    lk, keys = lookup()
    alone = lk.find(keys, 0.0)
    assert alone.cut and alone.pages == 0
    lk, keys = lookup()
    behind = lk.find(keys, 0.0, 0, 2000.0)
    assert not behind.cut and behind.pages == len(keys) and behind.ssd_pages == len(keys)
    assert lk.stats()["restored_requests"] == 1


def test_restores_ahead_are_charged_their_latency():
    """One small SSD page (0.06 s) against 16 tokens (0.016 s) behind 100 prefill tokens:
    with no restore ahead it restores; behind 20 restores (1 s of latency, no bytes
    counted) recomputing ends sooner."""
    lk, keys = lookup(pages_on_ssd=1, block_bytes=MIB // 4)
    assert not lk.find(keys, 0.0, 0, 100.0).cut
    lk, keys = lookup(pages_on_ssd=1, block_bytes=MIB // 4)
    assert lk.find(keys, 0.0, 20, 100.0).cut
