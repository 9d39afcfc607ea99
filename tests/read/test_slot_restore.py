"""``read/slot_restore.SlotRestorer``, the restore both modes share: what it refuses."""

from __future__ import annotations

import numpy as np
import pytest
from tests.support import blocks_for, chain

from sglang_flatcake.placement import WriteSignals
from sglang_flatcake.read.read_lease import open_lease
from sglang_flatcake.read.slot_restore import SlotRestorer
from sglang_flatcake.store import FlatCakeStore

SSD = WriteSignals(turn=9, context_tokens=100_000, prev_reply_tokens=5)


def dests(layout, slots):
    shape = (slots, 1, layout.part_bytes // layout.page_tokens // 4)      # float32, one head
    return ([np.zeros(shape, np.float32) for _ in range(layout.layers)],
            [np.zeros(shape, np.float32) for _ in range(layout.layers)])


@pytest.fixture
def written(tmp_path, config):
    from sglang_flatcake.layout import KVLayout
    lay = KVLayout.mha(layers=2, kv_heads=1, head_dim=4, dtype="float32", page_tokens=4)
    keys = chain(2)
    st = FlatCakeStore(tmp_path / "s", lay, config)
    st.put(keys, blocks_for(lay, keys), signals=SSD)
    yield st, keys
    st.close()


def test_several_leases_need_their_sizes_and_ssd_blocks_need_a_window(written):
    st, keys = written
    k, v = dests(st.layout, 16)
    r = SlotRestorer(k, v, None, st.config, 0)            # no window: memory blocks only
    slots = np.arange(2 * st.layout.page_tokens)
    with open_lease(st.core, keys) as a, open_lease(st.core, keys) as b:
        with pytest.raises(ValueError, match="2 leases need their sizes"):
            r.restore(st, [a, b], np.arange(16), verify=True)
        assert a.reads                                   # the blocks are on SSD
        with pytest.raises(ValueError, match="has no window"):
            r.restore(st, [a], slots, verify=True)
    r.close()


def test_on_layer_reports_each_layer_in_order_and_pace_sees_every_ssd_block(written):
    """The linker's use: each layer reported once, in order, after its blocks landed; the
    test hook ``pace`` runs before each SSD scatter with its block count."""
    st, keys = written
    lay = st.layout
    k, v = dests(lay, 16)
    r = SlotRestorer(k, v, None, st.config, 1 << 20, host_engine=st.engine)
    layers, paced = [], []
    slots = np.arange(2 * lay.page_tokens)
    with open_lease(st.core, keys) as lease:
        res = r.restore(st, [lease], slots, verify=True, on_layer=layers.append,
                        pace=paced.append)
    r.close()
    assert res.error is None and res.leases == ((2, 0),) and res.corrupt == ()
    assert layers == list(range(lay.layers))
    assert sum(paced) == 2 * lay.layers and res.ssd_bytes == 2 * lay.block_bytes
    want = blocks_for(lay, keys).reshape(2, lay.layers, 2, lay.page_tokens, -1)
    for layer in range(lay.layers):                   # page i, K then V, landed in its slots
        for i in range(2):
            got = [d[layer][i * lay.page_tokens:(i + 1) * lay.page_tokens] for d in (k, v)]
            assert all(g.view(np.uint8).reshape(lay.page_tokens, -1).tobytes()
                       == want[i, layer, part].tobytes() for part, g in enumerate(got))
