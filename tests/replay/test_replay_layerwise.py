"""The linker mode's layer-wise pipeline: hand-computed cases, then the replayed system."""

from __future__ import annotations

import pytest

from sglang_flatcake.replay.clock import EventLoop, SharedDisk
from sglang_flatcake.replay.layerwise import pipeline_end, serial_end
from sglang_flatcake.replay.policy import FCFS
from sglang_flatcake.replay.replayer import Replayer
from sglang_flatcake.replay.sizes import DISKS, GIB, GPUS, MODELS, make_sizing
from sglang_flatcake.replay.systems import SystemContext, make_system
from sglang_flatcake.replay.traces import Request, Trace


def test_restore_bound_ends_one_layer_of_compute_after_the_last_layer_lands():
    # 4 layers land at 2, 4, 6, 8; each layer computes 1 s: 3, 5, 7, 9
    assert pipeline_end(0.0, 0.0, 8.0, 4.0, 4) == pytest.approx(9.0)


def test_compute_bound_ends_one_layer_of_load_after_the_compute():
    # layer 1 lands at 1; then compute 2 s per layer back to back: 3, 5, 7, 9
    assert pipeline_end(0.0, 0.0, 4.0, 8.0, 4) == pytest.approx(9.0)


def test_equal_load_and_compute_overlap_all_but_one_layer():
    # lands 1, 2, 3, 4; compute 1 s each: 2, 3, 4, 5 (serial would take 8)
    assert pipeline_end(10.0, 10.0, 4.0, 4.0, 4) == pytest.approx(15.0)
    assert serial_end(10.0, 4.0, 4.0) == pytest.approx(18.0)


def test_one_layer_is_serial_and_a_late_load_start_shifts_every_layer():
    assert pipeline_end(0.0, 0.0, 3.0, 5.0, 1) == pytest.approx(8.0)
    # load starts 1 s into the forward: lands 3, 5; compute 1 s each: 4, 6
    assert pipeline_end(0.0, 1.0, 4.0, 2.0, 2) == pytest.approx(6.0)


@pytest.mark.parametrize("args", [(0.0, 0.0, -1.0, 1.0, 2), (0.0, 0.0, 1.0, 1.0, 0),
                                  (1.0, 0.0, 1.0, 1.0, 2)])
def test_bad_arguments_name_the_value(args):
    with pytest.raises(ValueError, match="="):
        pipeline_end(*args)


SIZING = make_sizing(MODELS["deepseek-v4-flash"], 64)
BB = SIZING.block_bytes
GPU = GPUS["b200x8"]


def _trace():
    first = tuple(f"a{i}" for i in range(8))
    second = first + tuple(f"b{i}" for i in range(40))
    reqs = [Request(0, 0, 0, "s", 0.0, 64 * len(first), 10, first, 0, 0, None, "t:1"),
            Request(1, 0, 0, "s", 100.0, 64 * len(second), 10, second, 1, 10, 0, "t:1")]
    return Trace("crafted", "weka", 64, tuple(reqs), 1)


def _replay(tmp_path, name):
    loop = EventLoop()
    root = tmp_path / name
    root.mkdir()
    ctx = SystemContext(loop, SharedDisk(loop), DISKS["local"], SIZING, 0, 400 * BB, 0, root, 0,
                        128, 2, 2, prefill_tps=GPU.prefill_tps)
    system = make_system(name)
    system.open(ctx)
    try:
        states = Replayer(_trace(), [0.0, 100.0], system, FCFS(), GPU, loop).run()
        stats = system.stats()
    finally:
        system.close()
    return states, stats


def test_the_linker_restores_under_the_prefill_and_hicache_mode_before_it(tmp_path):
    hicache, _ = _replay(tmp_path, "flatcake")
    linker, stats = _replay(tmp_path, "flatcake-linker")
    h, k = hicache[1], linker[1]
    assert h.delivered_ssd == k.delivered_ssd == 8 and stats["layer_wise_restores"] == 1
    load = h.prefetch_end - h.prefetch_start          # the same reads on an idle disk
    compute = 40 * 64 / GPU.prefill_tps
    h2d = h.h2d_full_bytes / (GPU.h2d_gib_s * GIB)
    assert load > 0 and h2d == k.h2d_full_bytes / (GPU.h2d_gib_s * GIB)
    assert h.first_token - h.arrival == pytest.approx(load + h2d + compute)
    # the linker: ready at arrival, its prefill is the pipeline of the read and the compute
    assert k.prefill_start == k.arrival
    want = h2d + pipeline_end(0.0, 0.0, load, compute, MODELS["deepseek-v4-flash"].layers)
    assert k.first_token - k.arrival == pytest.approx(want)
    assert want < load + h2d + compute - 0.9 * min(load, compute)
