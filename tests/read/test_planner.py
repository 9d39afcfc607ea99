import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_flatcake.layout import KVLayout, SegmentGeometry
from sglang_flatcake.read.planner import SegmentRead, plan_reads

ALIGN = 4096


def segments(layout, sizes, path="f"):
    """Segments of ``sizes`` blocks laid one after another in one file."""
    out, off = [], 0
    for n in sizes:
        g = SegmentGeometry(layout, n, ALIGN)
        out.append((path, off, g))
        off += g.total_bytes
    return out, off


def simulate(plan, files):
    """Apply the plan to in-memory files; return {(dest, layer): bytes}."""
    got = {}
    for j in range(len(plan.piece_cmd)):
        c = plan.commands[plan.piece_cmd[j]]
        buf = files[c.path][c.offset:c.offset + c.length]
        o = plan.piece_offset[j]
        got[(int(plan.piece_dest[j]), int(plan.piece_layer[j]))] = buf[o:o + plan.piece_bytes]
    return got


def reads_for(segs, wanted):
    reads, dest = [], 0
    for (path, off, g), idx in zip(segs, wanted):
        idx = np.asarray(sorted(idx), np.int64)
        if len(idx) == 0:
            continue
        reads.append(SegmentRead(path, off, g, idx, np.arange(dest, dest + len(idx)),
                                 np.zeros((g.layout.layers, len(idx)), np.uint64)))
        dest += len(idx)
    return reads


def check_plan(plan, layout, segs, wanted, files, merge_gap):
    cmds = plan.commands
    # sorted by (file, offset), aligned, not overlapping
    keys = [(c.path, c.offset) for c in cmds]
    assert keys == sorted(keys)
    for a, b in zip(cmds, cmds[1:]):
        if a.path == b.path:
            assert a.offset + a.length <= b.offset
    for c in cmds:
        assert c.offset % ALIGN == 0 and c.length % ALIGN == 0
    # every wanted byte read exactly as written
    got = simulate(plan, files)
    dest = 0
    for (path, off, g), idx in zip(segs, wanted):
        for i in sorted(idx):
            for l in range(layout.layers):
                s = off + g.block_offset(l, i)
                assert np.array_equal(got[(dest, l)], files[path][s:s + layout.block_layer_bytes])
            dest += 1
    assert len(got) == dest * layout.layers
    assert plan.bytes_wanted == dest * layout.layers * layout.block_layer_bytes
    assert plan.bytes_read == sum(c.length for c in cmds)


def test_full_restore_is_one_command_per_layer_per_turn():
    lay = KVLayout.mha(6, 2, 64, "bfloat16", 16)
    sizes = [5, 3, 8, 1]
    segs, size = segments(lay, sizes)
    files = {"f": np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)}
    wanted = [range(n) for n in sizes]
    plan = plan_reads(reads_for(segs, wanted), ALIGN, 64 << 10)
    assert plan.read_commands == lay.layers * len(sizes)
    check_plan(plan, lay, segs, wanted, files, 64 << 10)
    for l in range(lay.layers):
        assert len(plan.commands_for_layer(l)) == len(sizes)


def test_small_gaps_are_read_through_and_large_gaps_split():
    lay = KVLayout.mha(2, 2, 64, "bfloat16", 16)   # 8 KiB per block-layer
    segs, size = segments(lay, [40])
    files = {"f": np.arange(size, dtype=np.uint64).astype(np.uint8)}
    wanted = [[0, 1, 3, 30]]          # gap of 1 block (8 KiB) merges; gap of 26 blocks (208 KiB) splits
    plan = plan_reads(reads_for(segs, wanted), ALIGN, 64 << 10)
    assert plan.read_commands == 2 * lay.layers
    assert plan.gap_bytes == lay.layers * lay.block_layer_bytes
    check_plan(plan, lay, segs, wanted, files, 64 << 10)
    plan0 = plan_reads(reads_for(segs, wanted), ALIGN, 0)
    assert plan0.read_commands == 3 * lay.layers and plan0.gap_bytes == 0


def test_split_layers_off_merges_a_whole_segment():
    lay = KVLayout.mha(4, 2, 64, "bfloat16", 16)
    segs, size = segments(lay, [8])
    files = {"f": np.zeros(size, np.uint8)}
    plan = plan_reads(reads_for(segs, [range(8)]), ALIGN, 64 << 10, split_layers=False)
    assert plan.read_commands == 1 and plan.command_layer[0] == -1


def test_files_never_merge():
    lay = KVLayout.mla(2, 64, "float16", 16)
    a, sa = segments(lay, [4], "a")
    b, sb = segments(lay, [4], "b")
    rng = np.random.default_rng(1)
    files = {"a": rng.integers(0, 256, sa, dtype=np.uint8), "b": rng.integers(0, 256, sb, dtype=np.uint8)}
    plan = plan_reads(reads_for(a + b, [range(4), range(4)]), ALIGN, 1 << 30)
    assert {c.path for c in plan.commands} == {"a", "b"}
    check_plan(plan, lay, a + b, [range(4), range(4)], files, 1 << 30)


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 5),
    heads=st.sampled_from([1, 2, 3]),
    head_dim=st.sampled_from([8, 24, 64, 128]),
    dtype=st.sampled_from(["float32", "bfloat16", "float8_e4m3fn"]),
    mla=st.booleans(),
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    merge_gap=st.sampled_from([0, 4096, 64 << 10, 1 << 20]),
    data=st.data(),
)
def test_merged_plan_reads_every_wanted_byte(layers, heads, head_dim, dtype, mla, sizes, merge_gap, data):
    lay = (KVLayout.mla(layers, heads * head_dim, dtype, 4) if mla
           else KVLayout.mha(layers, heads, head_dim, dtype, 4))
    segs, size = segments(lay, sizes)
    files = {"f": np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)}
    wanted = [data.draw(st.sets(st.integers(0, n - 1))) for n in sizes]
    if not any(wanted):
        return
    plan = plan_reads(reads_for(segs, wanted), ALIGN, merge_gap)
    check_plan(plan, lay, segs, wanted, files, merge_gap)
    per_layer = [len(plan.commands_for_layer(l)) for l in range(layers)]
    assert max(per_layer) <= sum(len(w) for w in wanted)
