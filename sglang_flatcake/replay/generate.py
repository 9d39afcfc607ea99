"""Synthetic coding-agent traces, seeded, written as Mooncake JSON lines.

    python -m sglang_flatcake.replay.generate --sessions 8 --seed 1 --out agent.jsonl
    flatcake replay --trace agent.jsonl --format mooncake --block-tokens 256 ...

A session is one conversation of turns.  Every session's prompt starts with the same
``shared_prefix_tokens`` (system prompt and tool definitions); its first turn adds a
first context, each later turn adds the previous reply plus new tool output (the
*growth*), and comes a *think time* after the previous one.  The session ends after its
drawn number of turns or when the context would pass ``max_context``.  Sessions start
as a Poisson process.  Each quantity is log-normal; the defaults are fitted to the main
threads of the first 200 sessions of WEKA's Claude Code traces
(``/work/shared/traces/weka_claude_code_sessions.tar.xz``): first context median 24K
tokens, growth median 651 tokens per turn, reply median 216 tokens, think time (turn
start to next turn start) median 17 s, 37 turns median.

Hash ids are prefix-aware: a turn repeats its predecessor's full blocks and names its
own new ones, so the Mooncake loader links it to that turn (one conversation).  Times
in the file are only relative: a replay rescales them to its rate.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class AgentSpec:
    """What ``generate`` draws from; log-normal ``(log mean, log std)`` pairs."""

    sessions: int = 8
    seed: int = 0
    block_tokens: int = 256
    shared_prefix_tokens: int = 16_384
    first_context: tuple[float, float] = (10.688, 1.169)
    growth: tuple[float, float] = (6.635, 1.139)
    reply: tuple[float, float] = (5.583, 0.924)
    think_s: tuple[float, float] = (3.206, 1.220)
    turns: tuple[float, float] = (3.522, 1.117)
    max_turns: int = 30
    max_context: int = 200_000
    session_gap_s: float = 60.0          # mean gap between session starts

    def __post_init__(self) -> None:
        for name in ("sessions", "block_tokens", "max_turns", "max_context"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} is not allowed: expected >= 1")
        if self.shared_prefix_tokens < 0 or not self.session_gap_s > 0:
            raise ValueError(f"shared_prefix_tokens={self.shared_prefix_tokens!r}, "
                             f"session_gap_s={self.session_gap_s!r}: expected >= 0 and > 0")


def _draw(rng: np.random.Generator, p: tuple[float, float]) -> float:
    return float(rng.lognormal(p[0], p[1]))


def generate(spec: AgentSpec) -> list[dict]:
    """The trace's records in timestamp order (``timestamp`` ms, ``input_length``,
    ``output_length``, ``hash_ids``); the same spec gives the same records."""
    rng = np.random.default_rng(spec.seed)
    bt = spec.block_tokens
    shared = list(range(spec.shared_prefix_tokens // bt))
    next_id = len(shared)
    rows, start = [], 0.0
    for _ in range(spec.sessions):
        start += float(rng.exponential(spec.session_gap_s))
        n_turns = max(1, min(spec.max_turns, int(round(_draw(rng, spec.turns)))))
        ctx = spec.shared_prefix_tokens + int(_draw(rng, spec.first_context))
        ids: list[int] = list(shared)
        t = start
        for turn in range(n_turns):
            if ctx > spec.max_context:
                break
            full = ctx // bt
            while len(ids) < math.ceil(ctx / bt):
                ids.append(next_id)
                next_id += 1
            reply = max(1, int(_draw(rng, spec.reply)))
            rows.append({"timestamp": round(t * 1000.0, 3), "input_length": ctx,
                         "output_length": reply, "hash_ids": ids[:math.ceil(ctx / bt)]})
            ids = ids[:full]                       # a partial last block is not reused
            ctx += reply + int(_draw(rng, spec.growth))
            t += _draw(rng, spec.think_s)
    rows.sort(key=lambda r: r["timestamp"])
    return rows


def write(rows: list[dict], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=AgentSpec.sessions)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-tokens", type=int, default=AgentSpec.block_tokens)
    p.add_argument("--max-turns", type=int, default=AgentSpec.max_turns)
    p.add_argument("--shared-prefix-tokens", type=int, default=AgentSpec.shared_prefix_tokens)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    try:
        spec = AgentSpec(a.sessions, a.seed, a.block_tokens, a.shared_prefix_tokens,
                         max_turns=a.max_turns)
    except ValueError as e:
        print(f"generate: error: {e}", file=sys.stderr)
        return 2
    rows = generate(spec)
    write(rows, a.out)
    print(json.dumps({"out": a.out, "requests": len(rows), **{k: v for k, v in vars(a).items()
                                                              if k != "out"}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
