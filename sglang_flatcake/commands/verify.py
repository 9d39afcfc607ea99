"""``flatcake verify --url http://HOST:PORT``: does a running SGLang server restore from flatcake?

Against an operator's own server, in seconds, touching nothing of theirs: a prompt of fresh
random token ids under a fresh ``cache_salt`` (so no key of theirs is read or written), greedy,
with top logprobs; then, only with ``--allow-flush`` (it empties the server's device cache for
everyone), ``/flush_cache`` and the same prompt again.  The second answer must carry the same
tokens and logprobs within ``--atol``, and SGLang's cache report must credit the prompt to
flatcake (HiCache mode: ``storage``; the linker: ``host``).  The mode comes from
``/server_info``; the tier (memory, SSD) from flatcake's gauges in ``/metrics`` when the
server runs with ``--enable-metrics``.

Verdicts and exit codes: ``restored`` 0; ``not-flatcake`` 3 (the server has no flatcake),
``not-flushed`` 4 (no ``--allow-flush``: only a device hit was possible), ``not-restored`` 1
(recomputed), ``different`` 1 (restored, but another answer).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid

import numpy as np

from ..errors import FlatCakeError
from . import server_calls as sc

EXIT = {"restored": 0, "different": 1, "not-restored": 1, "not-flatcake": 3, "not-flushed": 4}
TIER_GAUGES = ("memory_blocks_read", "ssd_blocks_read")


class RemoteServer:
    """A running server at ``url``: the ``post``/``get`` the ``server_calls`` helpers use."""

    def __init__(self, url: str, timeout: float) -> None:
        if not url.startswith(("http://", "https://")):
            raise FlatCakeError(f"--url {url!r}: expected http://HOST:PORT")
        self.url, self.timeout = url.rstrip("/"), timeout

    def post(self, path: str, body: dict, timeout: float | None = None) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
            return json.loads(r.read() or b"{}")

    def get(self, path: str, timeout: float | None = None) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout or self.timeout) as r:
            return r.read().decode()


def server_mode(info: dict) -> str:
    """``hicache``, ``linker`` or ``none``: how flatcake sits in a server, from ``/server_info``."""
    linker = info.get("unified_cache_external_linker_config") or ""
    if info.get("enable_unified_cache_external_linker") and "FlatCakeLinker" in str(linker):
        return "linker"
    backend = info.get("hicache_storage_backend") or ""
    extra = str(info.get("hicache_storage_backend_extra_config") or "")
    if info.get("enable_hierarchical_cache") and (backend == "flatcake" or "flatcake" in extra):
        return "hicache"
    return "none"


def server_info(server: RemoteServer) -> dict:
    """``/server_info`` (``/get_server_info`` on servers without it)."""
    for path in ("/server_info", "/get_server_info"):
        try:
            return json.loads(server.get(path))
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise
    raise FlatCakeError(f"{server.url} answers neither /server_info nor /get_server_info")


def ask(server: RemoteServer, ids: list[int], salt: str, new_tokens: int, top: int) -> dict:
    """One greedy ``/generate`` under ``salt``: its tokens, logprobs, top logprobs, cache report."""
    r = server.post("/generate", {
        "input_ids": ids, "cache_salt": salt, "return_logprob": True, "top_logprobs_num": top,
        "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}})
    m = r["meta_info"]
    return {"tokens": list(r["output_ids"]), "logprobs": [t[0] for t in m["output_token_logprobs"]],
            "top": [[t[0] for t in step or []] for step in m.get("output_top_logprobs") or []],
            "cached": m.get("cached_tokens_details") or {}}


def tiers(server: RemoteServer) -> dict[str, int]:
    """flatcake's block-read gauges (empty without ``--enable-metrics``)."""
    g = sc.prometheus(server, "flatcake_")
    return {k: int(g.get(f"flatcake_{k}", 0)) for k in TIER_GAUGES if f"flatcake_{k}" in g}


def max_diff(a: list, b: list) -> float:
    """Largest absolute difference of two equal-shaped lists of floats (inf if shapes differ)."""
    try:
        x, y = np.array(a, dtype=float), np.array(b, dtype=float)
        return float(np.max(np.abs(x - y))) if x.shape == y.shape and x.size else (
            0.0 if x.shape == y.shape else float("inf"))
    except ValueError:
        return float("inf")


def verify(url: str, allow_flush: bool = False, tokens: int = 256, new_tokens: int = 8,
           top: int = 5, atol: float = 1e-3, settle_s: float = 2.0, timeout: float = 120.0,
           vocab_hi: int = 400) -> dict:
    """Run the check; the report (``verdict`` one of ``EXIT``'s keys)."""
    if tokens < 1 or new_tokens < 1:
        raise FlatCakeError(f"--tokens {tokens} / --new-tokens {new_tokens}: must be >= 1")
    server = RemoteServer(url, timeout)
    try:
        info = server_info(server)
    except (urllib.error.URLError, OSError) as e:
        raise FlatCakeError(f"{url}: no answer ({e})") from None
    mode = server_mode(info)
    page = int(info.get("page_size") or 1)
    salt = f"flatcake-verify-{uuid.uuid4().hex}"
    ids = [int(x) for x in np.random.default_rng().integers(2, vocab_hi, size=tokens)]
    report = {"url": url, "mode": mode, "page_size": page, "prompt_tokens": tokens,
              "cache_salt": salt, "flushed": False}
    if mode == "none":
        report.update(verdict="not-flatcake", why="the server runs without flatcake "
                      "(neither --hicache-storage-backend flatcake nor FlatCakeLinker)")
        return report
    t = time.perf_counter()
    first = ask(server, ids, salt, new_tokens, top)
    report["first_s"] = round(time.perf_counter() - t, 4)
    if allow_flush:
        sc.backup_tokens(server, settle_s=settle_s, timeout=timeout)   # HiCache's writes
        time.sleep(settle_s)                 # the linker's offload completes after the answer
        sc.flush(server, timeout=timeout)
        report["flushed"] = True
    before = tiers(server)
    t = time.perf_counter()
    again = ask(server, ids, salt, new_tokens, top)
    report["again_s"] = round(time.perf_counter() - t, 4)
    time.sleep(1.5 if before else 0)         # the gauges are exported about once a second
    after = tiers(server)
    where = "storage" if mode == "hicache" else "host"
    restored = int(again["cached"].get(where, 0))
    report.update(
        restored_tokens=restored, device_tokens=int(again["cached"].get("device", 0)),
        cached_tokens_details=again["cached"], same_tokens=first["tokens"] == again["tokens"],
        logprob_max_diff=max_diff(first["logprobs"], again["logprobs"]),
        top_logprob_max_diff=max_diff(first["top"], again["top"]),
        tier_blocks_read={k: after[k] - before.get(k, 0) for k in after} or None)
    same = (report["same_tokens"] and report["logprob_max_diff"] <= atol
            and report["top_logprob_max_diff"] <= atol)
    if not allow_flush:
        verdict, why = "not-flushed", ("the repeat was a device hit; pass --allow-flush to "
                                       "empty the device cache and check a restore")
    elif restored == 0:
        verdict, why = "not-restored", f"the repeat was recomputed (no {where} tokens)"
    elif not same:
        verdict, why = "different", "restored, but the answer differs beyond --atol"
    else:
        verdict, why = "restored", f"{restored} of {tokens} prompt tokens restored by flatcake " \
                                   f"({mode} mode), same answer"
    report.update(verdict=verdict, why=why)
    return report


def add_arguments(p) -> None:
    p.add_argument("--url", required=True, help="the running server, http://HOST:PORT")
    p.add_argument("--allow-flush", action="store_true",
                   help="POST /flush_cache between the two prompts (empties the device cache "
                        "for every user of the server); without it only a device hit is seen")
    p.add_argument("--tokens", type=int, default=256, help="prompt length in tokens")
    p.add_argument("--new-tokens", type=int, default=8, help="greedy tokens per answer")
    p.add_argument("--atol", type=float, default=1e-3,
                   help="largest logprob difference taken as the same answer")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--vocab-hi", type=int, default=400,
                   help="prompt token ids are drawn from [2, VOCAB_HI)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON line")


def run(args) -> int:
    r = verify(args.url, args.allow_flush, args.tokens, args.new_tokens, atol=args.atol,
               timeout=args.timeout, vocab_hi=args.vocab_hi)
    if args.json:
        print(json.dumps(r))
    else:
        print(f"flatcake verify: {r['verdict']}: {r['why']}")
        for k in ("mode", "restored_tokens", "device_tokens", "same_tokens", "logprob_max_diff",
                  "top_logprob_max_diff", "tier_blocks_read", "first_s", "again_s"):
            if k in r:
                print(f"  {k}: {r[k]}")
    return EXIT[r["verdict"]]
