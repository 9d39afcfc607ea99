"""Where restored KV goes: a concurrent multi-turn run, twice, on a real CPU flatcake server.

    python benchmarks/restore_use.py [--sessions 8] [--turns 3] [--no-hold] [--json OUT]

Each session's turn extends the one before (its prompt, a reply, a new user message), every
turn of every session is sent at once (as ``bench_serving``'s Mooncake rounds are), so
restores and prefills interleave on a small device pool.  Pass 1 fills the store; the device
cache is flushed; pass 2 sends the same requests again.  Prints one JSON document: what the
server restored (its ``flatcake: restored`` lines), what happened to each restored span
(``flatcake: <rid> admitted|departed: used U of N``), what SGLang credited to storage
(``cached_tokens_details.storage``) and the tokens prefilled.  ``--no-hold`` publishes
restores unlocked (``FLATCAKE_RESTORE_HOLD=0``, the code before holds).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sglang_flatcake.commands.demo import backup_tokens, flush
from sglang_flatcake.commands.server import ServerProcess, cpu_server_args
from sglang_flatcake.commands.tiny_model import build_tiny_llama

RESTORED = re.compile(r"flatcake: restored (\S+): (\d+) of (\d+) tokens")
DUPLICATE = re.compile(r"flatcake: restored .*; (\d+) were on device already")
FATE = re.compile(r"flatcake: (\S+) (admitted|departed): used (\d+) of (\d+) restored tokens")


def conversations(sessions: int, turns: int, base: int = 576, seed: int = 0) -> list[list[int]]:
    """Prompts (token ids): a session's first prompt is ``base`` tokens (+-1/3), turn t is
    turn t-1 + a 64-token reply + 192 tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(sessions):
        prompt = [rng.randrange(2, 500) for _ in range(rng.randrange(base * 2 // 3, base * 4 // 3))]
        for _ in range(turns):
            out.append(list(prompt))
            prompt += [rng.randrange(2, 500) for _ in range(64 + 192)]
    return out


def send_all(server: ServerProcess, prompts: list[list[int]]) -> list[dict]:
    """Every prompt at once; each answer's prompt and cache counts."""
    def one(ids):
        meta = server.post("/generate", {"input_ids": ids, "sampling_params": {
            "temperature": 0, "max_new_tokens": 8}})["meta_info"]
        d = meta.get("cached_tokens_details") or {}
        return {"prompt": meta["prompt_tokens"], "cached": meta.get("cached_tokens", 0),
                "device": d.get("device") or 0, "storage": d.get("storage") or 0}
    with ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(one, prompts))


def summary(answers: list[dict], log: str) -> dict:
    restored = [(m[1], int(m[2])) for m in RESTORED.finditer(log)]
    fates = [(m[1], m[2], int(m[3]), int(m[4])) for m in FATE.finditer(log)]
    prompt = sum(a["prompt"] for a in answers)
    return {"requests": len(answers), "prompt_tokens": prompt,
            "prefilled_tokens": prompt - sum(a["cached"] for a in answers),
            "device_cached_tokens": sum(a["device"] for a in answers),
            "storage_credited_tokens": sum(a["storage"] for a in answers),
            "restores": len(restored), "restored_tokens": sum(t for _, t in restored),
            "restored_tokens_on_device_already": sum(int(d) for d in DUPLICATE.findall(log)),
            "restored_tokens_used": sum(u for *_, u, _ in fates),
            "restored_tokens_unused": sum(n - u for *_, u, n in fates),
            "restored_tokens_departed": sum(n for _, how, _, n in fates if how == "departed"),
            "spans_settled": len(fates)}


def run(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="flatcake-restore-use-"))
    model = str(build_tiny_llama(work / "tiny-llama"))
    log_path = work / "server.log"
    env = {"FLATCAKE_RESTORE_HOLD": "0" if args.no_hold else "1"}
    prompts = conversations(args.sessions, args.turns, args.base_tokens)
    server_args = cpu_server_args(model, str(work / "store"), max_total_tokens=args.max_total_tokens,
                                  extra=["--schedule-policy", "fcfs", "--enable-metrics"])
    with ServerProcess(server_args, log_path=str(log_path), env=env) as s:
        first = send_all(s, prompts)
        backup_tokens(s)
        flush(s)
        mark = log_path.stat().st_size
        second = send_all(s, prompts)
        backup_tokens(s)                    # the last spans settle at a later step
        s.post("/generate", {"input_ids": [3] * 16, "sampling_params": {"max_new_tokens": 1}})
    log = log_path.read_bytes()[mark:].decode(errors="replace")
    return {"hold": not args.no_hold, "sessions": args.sessions, "turns": args.turns,
            "base_tokens": args.base_tokens,
            "max_total_tokens": args.max_total_tokens,
            "pass1": summary(first, ""), "pass2": summary(second, log), "log": str(log_path)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--base-tokens", type=int, default=576)
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument("--no-hold", action="store_true")
    p.add_argument("--json")
    args = p.parse_args(argv)
    out = run(args)
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
