from sglang_flatcake.address import Medium
from sglang_flatcake.config import FlatCakeConfig
from sglang_flatcake.placement import Rule, WriteSignals, place

CFG = FlatCakeConfig(short_reply_tokens=100, agent_context_tokens=1000, shared_refcount=2)


def p(memory_free=True, **kw):
    return place(WriteSignals(**kw), memory_free, CFG)


def test_shared_prefix_goes_to_memory():
    d = p(refcount=2, turn=0, context_tokens=5000, prev_reply_tokens=5000)
    assert d.medium == Medium.MEMORY and d.rule == Rule.SHARED_PREFIX


def test_later_turn_after_short_reply_goes_to_memory():
    d = p(turn=3, context_tokens=500, prev_reply_tokens=100)
    assert d.medium == Medium.MEMORY and d.rule == Rule.SHORT_CHAT


def test_first_turn_goes_to_ssd():
    d = p(turn=0, context_tokens=10, prev_reply_tokens=0)
    assert d.medium == Medium.SSD and d.rule == Rule.FIRST_TURN


def test_agent_context_goes_to_ssd():
    d = p(turn=2, context_tokens=1001, prev_reply_tokens=5)
    assert d.medium == Medium.SSD and d.rule == Rule.AGENT_CONTEXT
    assert p(turn=2, context_tokens=1000, prev_reply_tokens=5).medium == Medium.MEMORY


def test_long_previous_reply_goes_to_ssd():
    d = p(turn=2, context_tokens=10, prev_reply_tokens=101)
    assert d.medium == Medium.SSD and d.rule == Rule.LONG_REPLY


def test_memory_full_overrides_everything():
    d = p(memory_free=False, refcount=10, turn=5, context_tokens=1, prev_reply_tokens=1)
    assert d.medium == Medium.SSD and d.rule == Rule.MEMORY_FULL


def test_thresholds_are_flags():
    cfg = FlatCakeConfig(short_reply_tokens=10)
    assert place(WriteSignals(turn=1, prev_reply_tokens=50), True, cfg).rule == Rule.LONG_REPLY
    cfg = FlatCakeConfig(short_reply_tokens=100)
    assert place(WriteSignals(turn=1, prev_reply_tokens=50), True, cfg).rule == Rule.SHORT_CHAT


def test_place_takes_the_placement_part_alone_and_decides_the_same():
    from itertools import product

    from sglang_flatcake.config import PlacementConfig
    whole = FlatCakeConfig(short_reply_tokens=100, agent_context_tokens=1000, shared_refcount=3,
                           memory_bytes=0, io_threads=1)     # settings placement never reads
    part = PlacementConfig(short_reply_tokens=100, agent_context_tokens=1000, shared_refcount=3)
    assert whole.placement == part
    rules = set()
    for free, ref, turn, ctx, reply in product((True, False), (1, 3), (0, 1), (1000, 1001),
                                               (100, 101)):
        s = WriteSignals(refcount=ref, turn=turn, context_tokens=ctx, prev_reply_tokens=reply)
        d = place(s, free, part)
        assert d == place(s, free, whole) == place(s, free, whole.placement)
        rules.add(d.rule)
    assert rules == set(Rule)                                   # every rule was reached
