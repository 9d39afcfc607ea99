"""A real CPU server with ``--enable-metrics``: the backend's own gauges reach ``/metrics``
through SGLang's multi-process collector, labelled with the store, with no export error."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.server_args")
pytest.importorskip("transformers")

from sglang_flatcake.commands.processes import wait_until  # noqa: E402
from sglang_flatcake.commands.server import ServerProcess, cpu_server_args  # noqa: E402
from sglang_flatcake.commands.server_calls import prometheus  # noqa: E402
from sglang_flatcake.commands.tiny_model import build_tiny_llama  # noqa: E402

pytestmark = pytest.mark.e2e
PAGE = 16


def test_flatcake_gauges_reach_the_servers_metrics(tmp_path):
    model = str(build_tiny_llama(tmp_path / "tiny-llama"))
    args = cpu_server_args(model, str(tmp_path / "store"), PAGE, extra=["--enable-metrics"])
    with ServerProcess(args, log_path=str(tmp_path / "s.log")) as s:
        s.post("/generate", {"input_ids": list(range(2, 2 + 4 * PAGE)),
                             "sampling_params": {"temperature": 0, "max_new_tokens": 2}})
        def polled():            # SGLang polls get_stats on its own; each poll sets the gauges.
            m = prometheus(s, "flatcake_")  # HiCache backs pages up in the background, so a poll
            blocks = m.get("flatcake_blocks_ssd", 0) + m.get("flatcake_blocks_memory", 0)
            return (m.get("flatcake_sessions", 0) >= 1 and m.get("flatcake_metrics_gauges", 0) > 0
                    and blocks >= 4)     # may land between two of the four pages' writes
        wait_until(polled, 180, "flatcake_sessions >= 1 and 4 blocks in /metrics")
        m = prometheus(s, "flatcake_")
        text = s.get("/metrics")
    assert m["flatcake_metrics_enabled"] == 1.0 and m["flatcake_metrics_export_errors"] == 0
    assert m["flatcake_metrics_gauges"] > 10              # as of the export before the last
    assert m["flatcake_blocks_ssd"] + m["flatcake_blocks_memory"] >= 4
    assert 'flatcake_sessions{store="' in text and "tp0of1" in text
