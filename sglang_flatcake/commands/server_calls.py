"""What the demos, benchmarks and real-server tests ask of a running SGLang server over HTTP:
``/metrics`` sums, the backup count once it has settled, ``/flush_cache`` until accepted,
a greedy ``/generate`` with its logprobs and cache report; what a store directory holds
(``stored_blocks``, read offline while the server runs); seeded prompts (``prompt_ids``).
``DemoFailure`` for a demo that cannot go on (its message is one line a user can act on)."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from ..store import FlatCakeStore
from . import interrupts
from .processes import wait_until


class DemoFailure(Exception):
    """The demo cannot go on; the message is one line a user can act on."""


def prometheus(server, prefix: str) -> dict[str, float]:
    """Sum of each metric starting with ``prefix`` in the server's /metrics (labels dropped)."""
    out: dict[str, float] = {}
    try:
        text = server.get("/metrics")
    except (urllib.error.URLError, OSError):
        return out
    for line in text.splitlines():
        if line.startswith(prefix):
            name, value = line.rsplit(" ", 1)
            name = name.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def backup_tokens(server, settle_s: float = 3.0, timeout: float = 120.0) -> int:
    """Tokens the server has backed up to storage (``sglang:backuped_tokens_total``), read once
    the count has stopped moving for ``settle_s`` (backups finish after the answers)."""
    name = "sglang:backuped_tokens_total"
    last, since, deadline = None, time.time(), time.time() + timeout
    while time.time() < deadline:
        interrupts.check()
        v = prometheus(server, name).get(name, 0.0)
        if v != last:
            last, since = v, time.time()
        elif time.time() - since >= settle_s:
            break
        time.sleep(0.5)
    return int(last or 0)


def flush(server, timeout: float = 120) -> None:
    """POST /flush_cache until SGLang accepts it (it refuses, HTTP 400, while work is in
    flight); ``DemoFailure`` after ``timeout`` seconds or on any other answer."""
    def accepted() -> bool:
        req = urllib.request.Request(server.url + "/flush_cache", data=b"", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=120):
                return True
        except urllib.error.HTTPError as e:
            if e.code != 400:
                raise DemoFailure(f"/flush_cache answered HTTP {e.code}") from None
            return False
    try:
        wait_until(accepted, timeout, "SGLang to accept /flush_cache", every=1.0)
    except TimeoutError:
        raise DemoFailure(f"/flush_cache refused for {timeout}s: HTTP 400") from None


def prompt_ids(n: int, seed: int) -> list[int]:
    """``n`` token ids drawn from ``[2, 400)`` with ``seed`` (inside the tiny model's vocabulary)."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(2, 400, size=n)]


def generate(server, ids: list[int], new_tokens: int = 4, logprob: bool = True) -> dict:
    """POST /generate: greedy, exactly ``new_tokens`` new tokens (EOS ignored); the answer."""
    return server.post("/generate", {
        "input_ids": ids, "return_logprob": logprob,
        "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}})


def logprobs(resp: dict) -> np.ndarray:
    """The logprob of each new token of a ``generate(..., logprob=True)`` answer."""
    return np.array([t[0] for t in resp["meta_info"]["output_token_logprobs"]])


def cached_tokens(resp: dict, where: str) -> int:
    """Prompt tokens SGLang's cache report credits to ``where`` (``device``, ``host``,
    ``storage``; linker hits are reported as ``host``); 0 when the report has no such key."""
    return int((resp["meta_info"].get("cached_tokens_details") or {}).get(where, 0))


def stored_blocks(store_dir) -> int:
    """Blocks every store under ``store_dir`` (one per rank) holds on SSD, as an offline
    reader sees them (``FlatCakeStore.open_existing``; the server may be writing)."""
    total = 0
    for manifest in Path(store_dir).rglob("flatcake.json"):
        st = FlatCakeStore.open_existing(manifest.parent)
        try:
            total += sum(s.n_blocks for s in st.sessions.values())
        finally:
            st.close()
    return total
