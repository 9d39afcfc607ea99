"""Never later than recomputing (issue 31, part 4), HiCache mode: a real CPU server whose
store is throttled (``FLATCAKE_TEST_SSD_DELAY_S_PER_MIB``: restoring a history takes
seconds, its prefill a fraction of one) recomputes the history instead of waiting for it
once the disk probe has priced the disk: a small stored prompt restores first (no price
yet: it restores, slowly, and starts the probe), then both histories are recomputed, priced
from this disk (restore dearer than recompute), their TTFT near the uncached one, the
recomputes counted and nothing read for them."""

from __future__ import annotations

import itertools
import json
import re

import pytest

pytest.importorskip("sglang.srt.server_args")
pytest.importorskip("transformers")

from sglang_flatcake.commands.processes import wait_until  # noqa: E402
from sglang_flatcake.commands.server import ServerProcess, cpu_server_args  # noqa: E402
from sglang_flatcake.commands.server_calls import (cached_tokens, generate,  # noqa: E402
                                                   prometheus, prompt_ids)

from tests.support.throttled import (ENV, PAGE, PAGES, assert_not_waited,  # noqa: E402
                                     store_then_probe, timed)

pytestmark = pytest.mark.e2e


def test_a_throttled_history_is_recomputed_not_waited_for(model, tmp_path):
    store, log, tl = tmp_path / "store", tmp_path / "s.log", tmp_path / "t.jsonl"
    a, b = prompt_ids(PAGES * PAGE, 51), prompt_ids(PAGES * PAGE, 52)
    c = prompt_ids(3 * PAGE, 54)                      # restores in ~1 s: starts the probe
    args = cpu_server_args(model, str(store), PAGE,
                           extra=["--enable-metrics", "--flatcake-timeline", str(tl)])
    seeds = itertools.count(1000)
    with ServerProcess(args, env=ENV, log_path=str(log)) as s:
        uncached = store_then_probe(s, store, a, b, c, 53)   # c restored, unpriced: probe on

        def probed() -> bool:                         # a step exports the counters
            generate(s, prompt_ids(PAGE, next(seeds)), 1)
            return prometheus(s, "flatcake_direct_probe_reads").get(
                "flatcake_direct_probe_reads", 0) >= 1
        wait_until(probed, 120, "the disk probe's timed reads")
        took, out = timed(s, a)                       # priced from the probe now
        took_b, out_b = timed(s, b)
    text = log.read_text(errors="replace")
    assert cached_tokens(out, "storage") == 0 and cached_tokens(out_b, "storage") == 0
    assert_not_waited(took, took_b, uncached)
    assert len(re.findall(r"flatcake: \S+ recomputes", text)) >= 2, text[-3000:]
    rid = {out["meta_info"]["id"], out_b["meta_info"]["id"]}
    assert not [x for x in re.findall(r"flatcake: restored (\S+):", text) if x in rid]
    decisions = [json.loads(x) for x in tl.read_text().splitlines() if '"decision"' in x]
    mine = [d for d in decisions if d["rid"] in rid]
    assert len(mine) == 2 and not any(d["restore"] for d in mine), decisions
    assert all(d["restore_s"] > d["recompute_s"] > 0 for d in mine)   # priced here: slow
