"""Cut a small Mooncake-format slice out of WEKA agent sessions, for ``flatcake demo``.

The Mooncake trace format (also what SGLang's ``bench_serving --dataset-name mooncake``
reads) is JSON lines of ``{"timestamp" (ms), "hash_ids", "output_length"}``; the demo's
own client (``replay_client``) turns every hash id into a fixed run of token ids, so
equal ids give equal prefixes.  WEKA's Claude Code
sessions carry 64-token block ids local to each session; this keeps each
request's leading ``len(ids) // shrink`` ids (a prefix of a prefix is still a
prefix, so reuse is kept), makes ids global per session, and staggers sessions.

The vendored ``data/agent_slice_mooncake.jsonl`` was made by ``main()`` from the
WEKA kv-cache-tester traces (Copyright WEKA, Apache License 2.0).
"""

from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "data"
SLICE = DATA / "agent_slice_mooncake.jsonl"


def weka_sessions(tar_path: str):
    with tarfile.open(tar_path) as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            if m.isfile() and m.name.endswith(".json"):
                yield json.load(tar.extractfile(m))


def to_mooncake(sessions, max_requests: int = 8, shrink: int = 48, max_ids: int = 24,
                gap_s: float = 4.0, out_cap: int = 64) -> list[dict]:
    rows = []
    for si, sess in enumerate(sessions):
        base = (si + 1) * 1_000_000
        for r in [x for x in sess["requests"] if x.get("type") in ("n", "s")][:max_requests]:
            ids = r.get("hash_ids") or []
            keep = max(2, min(max_ids, len(ids) // shrink))
            rows.append({"timestamp": int((si * gap_s + float(r["t"])) * 1000),
                         "input_length": int(r["in"]),
                         "output_length": max(1, min(out_cap, int(r["out"]))),
                         "hash_ids": [base + int(h) for h in ids[:keep]]})
    rows.sort(key=lambda x: x["timestamp"])
    return rows


WEKA = "/work/shared/traces/weka_claude_code_sessions.tar.xz"
DEMO_SESSIONS = 4          # the vendored slice: the first 4 sessions with >= 6 requests


def agent_sessions(src: str, skip: int, count: int) -> list[dict]:
    """Sessions ``skip`` .. ``skip + count - 1`` of those with at least 6 requests, in
    file order (``skip=DEMO_SESSIONS``: held out from the vendored slice)."""
    return [s for s in weka_sessions(src) if len(s.get("requests", [])) >= 6][skip:skip + count]


def held_out_rows(src: str = WEKA, count: int = DEMO_SESSIONS) -> list[dict]:
    """The demo slice's recipe on the next ``count`` sessions: an agent trace the vendored
    slice (and any tuning on it) never saw.  ``FileNotFoundError`` names a missing ``src``."""
    if not Path(src).is_file():
        raise FileNotFoundError(f"{src}: the WEKA Claude Code sessions archive is not there")
    return to_mooncake(agent_sessions(src, DEMO_SESSIONS, count))


def main(argv: list[str]) -> int:
    src = argv[0] if argv else "../shared/traces/weka_claude_code_sessions.tar.xz"
    sessions = agent_sessions(src, 0, DEMO_SESSIONS)
    rows = to_mooncake(sessions)
    DATA.mkdir(exist_ok=True)
    SLICE.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} requests from {len(sessions)} sessions to {SLICE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
