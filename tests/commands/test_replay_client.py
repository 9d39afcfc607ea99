"""The demo's replay client counts from the responses: served, aborted, rejected, short.

The answers come from a local HTTP server that speaks SGLang's streamed
``/generate`` shapes (``data: {...}`` lines, ``meta_info`` with
``finish_reason`` and ``cached_tokens_details``, an HTTP 400 with an error body);
the e2e tests run the same client against a real SGLang server.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sglang_flatcake.commands.replay_client import (BLOCK_TOKENS, TraceRequest, load_trace,
                                                  replay, send_one)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = len(body["input_ids"])
        want = body["sampling_params"]["max_new_tokens"]
        if n > 100:                                     # as SGLang rejects a too-long prompt
            self.send_response(400)
            self.end_headers()
            self.wfile.write(json.dumps({"error": {"message": f"The input ({n} tokens) is longer "
                                                   "than the model's\ncontext length (100 tokens)."
                                                   }}).encode())
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        got = want if n not in (7, 11) else want // 2   # 7, 11 tokens: stop short
        if n == 11:                                     # one chunk, then the stream closes
            meta = {"completion_tokens": 1, "prompt_tokens": n}
            self.wfile.write(f"data: {json.dumps({'output_ids': [5], 'meta_info': meta})}\n\n"
                             .encode())
            return
        finish = {"type": "length", "length": got}
        if n == 9:
            finish = {"type": "abort", "message": "aborted by the scheduler"}
        for i in range(1, got + 1):
            meta = {"completion_tokens": i, "prompt_tokens": n,
                    "cached_tokens_details": {"device": 2, "host": 1, "storage": 3}}
            if i == got:
                meta["finish_reason"] = finish
            self.wfile.write(f"data: {json.dumps({'output_ids': [5] * i, 'meta_info': meta})}\n\n"
                             .encode())
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture(scope="module")
def url():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    t.join()


def req(n, out=4):
    return TraceRequest(0.0, list(range(n)), out)


def test_served_request_counts_tokens_from_the_response(url):
    o = send_one(url, 0, req(20))
    assert o.served and o.output_tokens == 4 and (o.device, o.host, o.storage) == (2, 1, 3)
    assert o.ttft_s is not None and o.latency_s >= o.ttft_s


def test_rejected_aborted_and_short_requests_are_failures_with_the_servers_reason(url):
    rejected = send_one(url, 0, req(200))
    assert not rejected.served and rejected.error.startswith("HTTP 400: The input (200 tokens)")
    assert "\n" not in rejected.error and "context length (100 tokens)" in rejected.error
    aborted = send_one(url, 1, req(9))
    assert not aborted.served and "aborted by the scheduler" in aborted.error
    short = send_one(url, 2, req(7, 6))
    assert not short.served and "served 3 of 6 output tokens" in short.error
    assert "then [DONE]" in short.error
    cut = send_one(url, 3, req(11, 6))
    assert not cut.served and "served 1 of 6 output tokens" in cut.error
    assert "closed without [DONE]" in cut.error and "finish_reason None" in cut.error


def test_a_client_side_exception_is_a_failed_outcome_not_a_lost_request(url, monkeypatch):
    import sglang_flatcake.commands.replay_client as rc

    def boom(url, i, r, timeout=1800):
        raise RuntimeError("client broke")
    monkeypatch.setattr(rc, "send_one", boom)
    res = rc.replay(url, [req(20), req(30)])
    assert res.summary["requests_sent"] == 2 and res.summary["requests_served"] == 0
    assert "client error: RuntimeError: client broke" in res.first_failure()


def test_replay_summary_counts_only_served_requests(url):
    res = replay(url, [req(20), req(200), req(30, 8)])
    s = res.summary
    assert (s["requests_sent"], s["requests_served"], s["output_tokens"]) == (3, 2, 12)
    assert s["storage_tokens"] == 6 and s["prompt_tokens"] == 50
    assert res.first_failure().startswith("request 1 (200 tokens): HTTP 400")


def test_trace_prompts_share_prefixes_by_hash_id(tmp_path):
    p = tmp_path / "t.jsonl"
    rows = [{"timestamp": 1000, "hash_ids": [1, 2], "output_length": 3},
            {"timestamp": 3000, "hash_ids": [1, 2, 3], "output_length": 0},
            {"timestamp": 5000, "hash_ids": [4], "output_length": 9}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b, c = load_trace(p, slowdown=0.5)
    assert len(a.input_ids) == 2 * BLOCK_TOKENS and len(b.input_ids) == 3 * BLOCK_TOKENS
    assert b.input_ids[: 2 * BLOCK_TOKENS] == a.input_ids
    assert c.input_ids[:BLOCK_TOKENS] != a.input_ids[:BLOCK_TOKENS]
    assert [x.at_s for x in (a, b, c)] == [0.0, 1.0, 2.0]
    assert (a.output_len, b.output_len) == (3, 1)
    assert len(load_trace(p, limit=2)) == 2
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no requests"):
        load_trace(empty)


def test_replay_reports_progress_sent_answered_served(url):
    seen = []
    reqs = [req(20), req(200), TraceRequest(0.6, list(range(30)), 8)]   # the last one sent late
    res = replay(url, reqs, progress=seen.append, tick_s=0.1)
    assert len(res.outcomes) == 3
    last = seen[-1]
    assert (last.sent, last.answered, last.served, last.total) == (3, 3, 2, 3)
    assert any(p.sent < 3 for p in seen), "progress is reported while requests are outstanding"
    for a, b in zip(seen, seen[1:]):
        assert a.sent <= b.sent and a.answered <= b.answered and a.elapsed_s <= b.elapsed_s
    assert all(p.served <= p.answered <= p.sent <= p.total for p in seen)
