"""Never later than recomputing (issue 31, part 4), linker mode: a real CPU server with
``FlatCakeLinker`` whose store is throttled (``FLATCAKE_TEST_SSD_DELAY_S_PER_MIB``: a
stored history restores in seconds, prefills in a fraction of one) recomputes it once the
disk probe has priced the disk: a small stored prompt restores first (no price yet; its
lookup starts the probe), then the histories are recomputed, the prefill priced from the
scheduler's counter (``linker/prefill.py``) and the restore from the probe's reads, their
TTFT near the uncached one, nothing loaded for them."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("sglang.srt.mem_cache.unified_cache.unified_cache_linker")
pytest.importorskip("transformers")

from sglang_flatcake.commands.server import ServerProcess, cpu_server_args  # noqa: E402
from sglang_flatcake.commands.server_calls import cached_tokens, prompt_ids  # noqa: E402

from tests.support.throttled import (ENV, PAGE, PAGES, assert_not_waited,  # noqa: E402
                                     store_then_probe, timed)

pytestmark = pytest.mark.e2e


def test_a_throttled_history_is_recomputed_not_waited_for(model, tmp_path):
    store, log, tl = tmp_path / "store", tmp_path / "s.log", tmp_path / "t.jsonl"
    a, b = prompt_ids(PAGES * PAGE, 61), prompt_ids(PAGES * PAGE, 62)
    c = prompt_ids(3 * PAGE, 64)                      # restores in ~1 s: starts the probe
    args = cpu_server_args(model, str(store), PAGE, backend="flatcake-linker",
                           extra=["--flatcake-timeline", str(tl)])
    with ServerProcess(args, env=ENV, log_path=str(log)) as s:
        uncached = store_then_probe(s, store, a, b, c, 63)   # c loaded, unpriced: probe on
        time.sleep(5)    # the probe's three reads, ~2 s at DELAY (no event shows them end)
        took, out = timed(s, a)
        took_b, out_b = timed(s, b)
    assert cached_tokens(out, "host") == 0 and cached_tokens(out_b, "host") == 0
    assert_not_waited(took, took_b, uncached)
    events = [json.loads(x) for x in tl.read_text().splitlines()]
    rid = {out["meta_info"]["id"], out_b["meta_info"]["id"]}
    mine = [e for e in events if e["ev"] == "decision" and e["rid"] in rid]
    assert len(mine) == 2 and not any(d["restore"] for d in mine), events
    assert all(d["prefill_tokens_per_s"] for d in mine)            # priced, measured here
    assert all(d["restore_s"] > d["recompute_s"] for d in mine)    # the probe's price: slow
    assert not [e for e in events if e["ev"] == "restore_start" and e["rid"] in rid]
