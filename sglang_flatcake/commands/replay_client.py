"""Replay a Mooncake-format trace against a running SGLang server, counting from the responses.

Each trace row ``{"timestamp" (ms), "hash_ids", "output_length"}`` becomes one
streamed ``/generate`` request sent at ``timestamp * slowdown``.  Its prompt is
``block_tokens`` token ids per hash id, drawn from a generator seeded by the id,
so equal ids give equal prefixes (as in ``bench_serving --dataset-name
mooncake``, but with exact token counts and no tokenizer in the way).

What is counted comes from the server's own answers: a request is *served* only
when it finished normally with every output token it asked for; a rejected,
aborted or short request is a failure carrying the server's one-line reason.
Cache tokens (device / host / storage) are summed from each response's
``cached_tokens_details``.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import interrupts

BLOCK_TOKENS = 512              # tokens per hash id, as bench_serving's mooncake dataset


@dataclass(frozen=True)
class TraceRequest:
    at_s: float                 # send time, seconds after the start (already slowed down)
    input_ids: list
    output_len: int


@dataclass
class Outcome:
    index: int
    prompt_tokens: int
    wanted_tokens: int
    output_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    device: int = 0
    host: int = 0
    storage: int = 0
    error: str | None = None    # None: served

    @property
    def served(self) -> bool:
        return self.error is None


def load_trace(path: str | Path, slowdown: float = 1.0, block_tokens: int = BLOCK_TOKENS,
               vocab: tuple[int, int] = (2, 400), limit: int | None = None) -> list[TraceRequest]:
    """The trace's rows as requests, first ``limit`` only; ``slowdown`` scales the timestamps."""
    rows = [json.loads(line) for line in open(path) if line.strip()][: limit or None]
    if not rows:
        raise ValueError(f"trace {path} has no requests")
    t0 = min(r["timestamp"] for r in rows)
    blocks: dict[int, list] = {}
    out = []
    for r in rows:
        ids = []
        for h in r["hash_ids"]:
            if h not in blocks:
                rng = np.random.default_rng(int(h))
                blocks[h] = [int(x) for x in rng.integers(vocab[0], vocab[1], size=block_tokens)]
            ids += blocks[h]
        out.append(TraceRequest((r["timestamp"] - t0) / 1000.0 * slowdown, ids,
                                max(1, int(r["output_length"]))))
    return out


def _reason(text: str) -> str:
    """The server's message, on one line."""
    try:
        doc = json.loads(text)
        err = doc.get("error", doc) if isinstance(doc, dict) else doc
        msg = err.get("message", err) if isinstance(err, dict) else err
        text = str(msg)
    except (ValueError, AttributeError):
        pass
    return " ".join(str(text).split())[:400] or "empty response"


def send_one(url: str, i: int, req: TraceRequest, timeout: float = 1800) -> Outcome:
    """Send one streamed request; every way it can fail ends in ``Outcome.error``."""
    o = Outcome(i, len(req.input_ids), req.output_len)
    body = {"input_ids": req.input_ids, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": req.output_len,
                                "ignore_eos": True}}
    ask = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    meta: dict = {}
    done = False
    try:
        with urllib.request.urlopen(ask, timeout=timeout) as r:
            for raw in r:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    o.error = _reason(data)
                    return o
                if o.ttft_s is None and chunk.get("output_ids"):
                    o.ttft_s = time.perf_counter() - t0
                meta = chunk.get("meta_info") or meta
    except urllib.error.HTTPError as e:
        o.error = f"HTTP {e.code}: {_reason(e.read().decode(errors='replace'))}"
        return o
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
        o.error = f"{type(e).__name__}: {e}"
        return o
    o.latency_s = time.perf_counter() - t0
    o.output_tokens = int(meta.get("completion_tokens", 0))
    details = meta.get("cached_tokens_details") or {}
    o.device, o.host = int(details.get("device", 0)), int(details.get("host", 0))
    o.storage = int(details.get("storage", 0))
    finish = meta.get("finish_reason") or {}
    if isinstance(finish, dict) and finish.get("type") == "abort":
        o.error = _reason(json.dumps(finish))
    elif o.output_tokens < req.output_len:
        how = "then [DONE]" if done else "then the stream closed without [DONE]"
        o.error = (f"served {o.output_tokens} of {req.output_len} output tokens, the last chunk "
                   f"unfinished (finish_reason {finish or None}), {how} after "
                   f"{o.latency_s:.1f} s")
    return o


@dataclass
class ReplayResult:
    outcomes: list[Outcome]
    wall_s: float
    summary: dict = field(default_factory=dict)

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.served]

    def first_failure(self) -> str | None:
        f = self.failures
        return None if not f else f"request {f[0].index} ({f[0].prompt_tokens} tokens): {f[0].error}"


def summarize(outcomes: list[Outcome], wall_s: float) -> dict:
    served = [o for o in outcomes if o.served]
    ttft = np.array([o.ttft_s for o in served if o.ttft_s is not None], dtype=float)
    return {"requests_sent": len(outcomes), "requests_served": len(served),
            "prompt_tokens": sum(o.prompt_tokens for o in served),
            "output_tokens": sum(o.output_tokens for o in served),
            "device_tokens": sum(o.device for o in served),
            "host_tokens": sum(o.host for o in served),
            "storage_tokens": sum(o.storage for o in served),
            "ttft_s_mean": round(float(ttft.mean()), 4) if len(ttft) else None,
            "ttft_s_p99": round(float(np.percentile(ttft, 99)), 4) if len(ttft) else None,
            "wall_s": round(wall_s, 2)}


@dataclass(frozen=True)
class ReplayProgress:
    """Where a replay stands: requests sent so far, answered (served or failed), served."""
    sent: int
    answered: int
    served: int
    total: int
    elapsed_s: float


def replay(url: str, requests: list[TraceRequest], progress=None,
           tick_s: float = 1.0) -> ReplayResult:
    """Send every request at its time (one thread each) and wait for all answers.

    ``progress``, if given, is called from the calling thread with a ``ReplayProgress``
    about every ``tick_s`` seconds and at each answer, and once more at the end."""
    outcomes: list[Outcome | None] = [None] * len(requests)
    start = time.perf_counter()
    changed = threading.Condition()
    counts = {"sent": 0, "answered": 0, "served": 0}

    def worker(i: int, req: TraceRequest) -> None:
        delay = req.at_s - (time.perf_counter() - start)
        if delay > 0:
            time.sleep(delay)          # open-loop arrivals at the trace's times
        with changed:
            counts["sent"] += 1
        try:
            outcomes[i] = send_one(url, i, req)
        except Exception as e:         # noqa: BLE001 - a failed request is an outcome, not lost
            outcomes[i] = Outcome(i, len(req.input_ids), req.output_len,
                                  error=f"client error: {type(e).__name__}: {e}")
        finally:
            with changed:
                counts["answered"] += 1
                counts["served"] += bool(outcomes[i] and outcomes[i].served)
                changed.notify()

    def report() -> None:
        if progress is not None:
            with changed:
                now = ReplayProgress(total=len(requests),
                                     elapsed_s=time.perf_counter() - start, **counts)
            progress(now)

    threads = [threading.Thread(target=worker, args=(i, r), daemon=True)
               for i, r in enumerate(requests)]
    for t in threads:
        t.start()
    while True:
        interrupts.check()             # a Ctrl-C that a finalizer swallowed
        report()
        with changed:
            if counts["answered"] >= len(requests):
                break
            changed.wait(timeout=tick_s)
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done = [o for o in outcomes if o is not None]
    return ReplayResult(done, wall, summarize(done, wall))


def outcomes_json(res: ReplayResult) -> list[dict]:
    return [asdict(o) for o in res.outcomes]
