"""The steps of ``flatcake demo --nodes 2`` (``demo_cluster``): every turn on the reference
server first, then the same token ids on the nodes, node 0 killed on the way."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import numpy as np

from .server_calls import DemoFailure, backup_tokens, flush, prometheus
from .processes import wait_until

PAGE, TIMEOUT_S = 16, 1.0
RESTORE_SLACK_S = 0.5       # a restore's wait past the bound: thread start-up on a loaded CPU
SLACK_S = 2.0               # a request past bound + its prefill on the reference: CPU noise
RESTORED = re.compile(r"flatcake: restored (\S+): (\d+) of (\d+) tokens .* in ([\d.]+)s")
STEPS = [("s1 turn 1", 0, "s1", 600, 16), ("s1 turn 2", 0, "s1", 40, 16),
         ("s2 turn 1", 0, "s2", 600, 16), ("s1 turn 3 (handed over)", 1, "s1", 8, 8),
         ("kill node 0", None, None, 0, 0), ("s2 turn 2 (owner dead)", 1, "s2", 8, 8),
         ("flush node 1", None, None, 0, 0), ("s1 turn 4 (owner dead)", 1, "s1", 8, 8)]


def _generate(server, ids, new):
    t = time.monotonic()
    r = server.post("/generate", {"input_ids": ids, "return_logprob": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": new, "ignore_eos": True}})
    m = r["meta_info"]
    return {"out": [t[1] for t in m["output_token_logprobs"]], "s": time.monotonic() - t,
            "lp": [t[0] for t in m["output_token_logprobs"]], "prompt": m["prompt_tokens"],
            "storage": int((m.get("cached_tokens_details") or {}).get("storage", 0)),
            "rid": m.get("id", "")}


def restore_seconds(log_path, rid: str) -> float | None:
    """How long the server's direct restore of request ``rid`` took (its log line), if any."""
    found = [float(m[4]) for m in RESTORED.finditer(Path(log_path).read_text(errors="replace"))
             if m[1] == rid]
    return found[-1] if found else None


def reference(server) -> list[dict]:
    """Every turn on the no-cache server; each turn's ids extend the session with its reply."""
    rng, hist, out = np.random.default_rng(7), {}, []
    for name, node, sess, new_tokens, gen in STEPS:
        if sess is None:
            continue
        ids = hist.get(sess, []) + [int(x) for x in rng.integers(2, 400, new_tokens)]
        got = _generate(server, ids, gen)
        hist[sess] = ids + got["out"]
        out.append({"step": name, "node": node, "ids": ids, "gen": gen, "ref": got})
    return out


def _published(url: str) -> int:
    import redis
    r = redis.Redis.from_url(url)
    try:
        return sum(1 for _ in r.scan_iter("fc:t:*:p:*", count=1000))
    finally:
        r.close()


def scenario(turns, nodes, url) -> dict:
    rows, it = [], iter(turns)
    for name, node, sess, _, _ in STEPS:
        if name == "kill node 0":
            os.killpg(nodes[0].proc.pid, signal.SIGKILL)
            nodes[0].proc.wait()
            rows.append({"step": name})
            continue
        if name == "flush node 1":
            backup_tokens(nodes[1])        # a flush drops backups still queued: let them land
            flush(nodes[1])
            rows.append({"step": name})
            continue
        t = next(it)
        if name.startswith("s1 turn 3"):        # node 0 has stored and published the history
            want = backup_tokens(nodes[0]) // PAGE - 2
            try:
                wait_until(lambda: _published(url) >= want, 60, "node 0's pages in the directory")
            except TimeoutError as e:
                raise DemoFailure(str(e)) from None
        try:
            got = _generate(nodes[node], t["ids"], t["gen"])
        except OSError as e:
            raise DemoFailure(f"{name} on node {node} failed: {e}") from None
        same = bool(np.allclose(got["lp"], t["ref"]["lp"], atol=1e-3))
        rows.append({"step": name, "node": node, "prompt_tokens": got["prompt"],
                     "storage_tokens": got["storage"], "same_logprobs": same,
                     "seconds": round(got["s"], 3), "reference_seconds": round(t["ref"]["s"], 3),
                     "restore_s": restore_seconds(nodes[node].log_path, got["rid"])})
    hand = next(r for r in rows if r["step"].startswith("s1 turn 3"))
    after = [r for r in rows if "owner dead" in r["step"]]
    ok = all(r["same_logprobs"] and (r["restore_s"] or 0) <= TIMEOUT_S + RESTORE_SLACK_S
             and r["seconds"] <= TIMEOUT_S + r["reference_seconds"] + SLACK_S for r in after)
    return {"prompt_tokens": hand["prompt_tokens"], "remote_storage_tokens": hand["storage_tokens"],
            "same_logprobs": hand["same_logprobs"], "after_owner_killed_ok": ok, "steps": rows,
            "node1_cluster": prometheus(nodes[1], "flatcake_cluster_")}


