"""Line up two servers' per-request timelines and name the stages that make up the TTFT gap.

    python benchmarks/timeline_diff.py BASE.jsonl MODE.jsonl [--json OUT] [--top N]

BASE and MODE are files a server wrote with ``--flatcake-timeline`` (or one pass's slice of
one, as ``benchmarks/sglang_clients.py --timeline DIR`` writes them): usually a no-cache
server and a flatcake mode's, same requests.  Requests are matched by prompt (the arrival's
``prompt`` hash; the k-th arrival of a prompt in one run with the k-th in the other), not by
rid (clients draw new rids).  Each request's events are put in time order from its arrival to
its first token; a stage is the time between two consecutive events, named ``A->B``
(``decision`` events are named with where they were made, ``decision@start``).  A stage a
run does not have counts 0 there, so for every request the stages' differences add up to its
TTFT difference (first token less arrival, server side).  The stages of the two runs differ
(a flatcake mode has a lookup, a restore ...), so each TTFT is also split in two segments
both runs have: ``wait`` (arrival to its first forward) and ``forward`` (first forward to
first token).  Prints the configuration, a table (segment and stage, mean ms in each run,
mean difference; over all matched requests and over the 10 % whose TTFT grew most) and one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

END = "first_token"


def load(path: str | Path) -> dict[str, list[dict]]:
    """Events by rid, each rid's in file order (lines that are not JSON are skipped)."""
    out: dict[str, list[dict]] = defaultdict(list)
    with open(path) as f:
        for line in f:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if isinstance(e, dict) and "rid" in e and "ev" in e and "t" in e:
                out[str(e["rid"])].append(e)
    return out


def _name(e: dict) -> str:
    return f"{e['ev']}@{e['at']}" if e["ev"] == "decision" and "at" in e else e["ev"]


def stages(events: list[dict]) -> dict[str, float] | None:
    """``{"A->B": seconds}`` from arrival to first token (the first of each event name, in
    time order), or None when the request has no arrival or no first token."""
    first: dict[str, float] = {}
    for e in events:
        first.setdefault(_name(e), float(e["t"]))
    if "arrival" not in first or END not in first:
        return None
    t0, t1 = first["arrival"], first[END]
    order = {n: i for i, n in enumerate(first)}        # ties keep the order written
    seq = sorted((t, order[n], n) for n, t in first.items()
                 if t0 <= t <= t1 and n not in ("arrival", END))
    out: dict[str, float] = {}
    prev_t, prev_n = t0, "arrival"
    for t, _, n in [*seq, (t1, 0, END)]:
        key = f"{prev_n}->{n}"
        out[key] = out.get(key, 0.0) + (t - prev_t)
        prev_t, prev_n = t, n
    return out


def segments(st: dict[str, float]) -> dict[str, float]:
    """``wait`` (arrival to first forward) and ``forward`` (first forward to first token) of a
    request's stages (in time order, as ``stages`` gives them); all of it is ``wait`` when it
    has no forward event."""
    out, part = {"wait": 0.0, "forward": 0.0}, "wait"
    for k, v in st.items():
        part = "forward" if k.startswith("forward->") else part
        out[part] += v
    return out


def by_prompt(run: dict[str, list[dict]]) -> dict[tuple[str, int], dict]:
    """``(prompt hash, k)`` -> ``{"rid", "stages", "ttft"}`` for each complete request, k
    counting arrivals of one prompt in arrival order."""
    rows = []
    for rid, evs in run.items():
        arr = next((e for e in evs if e["ev"] == "arrival"), None)
        st = stages(evs)
        if arr is not None and st is not None:
            rows.append((float(arr["t"]), str(arr.get("prompt", rid)), rid, st))
    seen: dict[str, int] = defaultdict(int)
    out = {}
    for t, prompt, rid, st in sorted(rows):
        out[(prompt, seen[prompt])] = {"rid": rid, "stages": st, "ttft": sum(st.values())}
        seen[prompt] += 1
    return out


def compare(base_path: str | Path, mode_path: str | Path) -> dict:
    """The matched requests' mean TTFT in each run and, per stage, the mean seconds in each
    run and their difference; the same over the worst decile (largest TTFT difference)."""
    base, mode = by_prompt(load(base_path)), by_prompt(load(mode_path))
    keys = sorted(set(base) & set(mode))
    result = {"base": str(base_path), "mode": str(mode_path), "matched": len(keys),
              "only_base": len(set(base) - set(mode)), "only_mode": len(set(mode) - set(base))}
    if not keys:
        return {**result, "all": None, "worst_decile": None}
    keys.sort(key=lambda k: mode[k]["ttft"] - base[k]["ttft"], reverse=True)
    result["all"] = _summary(keys, base, mode)
    result["worst_decile"] = _summary(keys[:max(1, len(keys) // 10)], base, mode)
    return result


def _summary(keys: list, base: dict, mode: dict) -> dict:
    n = len(keys)
    def rows_of(part):
        names = sorted({s for k in keys for s in (*part(base[k]), *part(mode[k]))})
        rows = []
        for s in names:
            b = sum(part(base[k]).get(s, 0.0) for k in keys) / n
            m = sum(part(mode[k]).get(s, 0.0) for k in keys) / n
            rows.append({"stage": s, "base_ms": round(b * 1e3, 2), "mode_ms": round(m * 1e3, 2),
                         "diff_ms": round((m - b) * 1e3, 2)})
        return sorted(rows, key=lambda r: abs(r["diff_ms"]), reverse=True)
    rows = rows_of(lambda r: r["stages"])
    segs = rows_of(lambda r: segments(r["stages"]))
    tb = sum(base[k]["ttft"] for k in keys) / n
    tm = sum(mode[k]["ttft"] for k in keys) / n
    return {"requests": n, "ttft_base_ms": round(tb * 1e3, 2), "ttft_mode_ms": round(tm * 1e3, 2),
            "ttft_diff_ms": round((tm - tb) * 1e3, 2), "segments": segs, "stages": rows}


def table(result: dict, top: int = 8) -> str:
    """Markdown: per summary, the ``top`` stages by size of difference."""
    out = [f"{result['matched']} requests matched ({result['only_base']} only in base, "
           f"{result['only_mode']} only in mode)"]
    for part in ("all", "worst_decile"):
        s = result.get(part)
        if not s:
            continue
        out += ["", f"**{part}** ({s['requests']} requests): TTFT {s['ttft_base_ms']} -> "
                    f"{s['ttft_mode_ms']} ms ({s['ttft_diff_ms']:+} ms)", "",
                "| stage | base ms | mode ms | difference ms |", "|---|---|---|---|"]
        out += [f"| **{r['stage']}** | {r['base_ms']} | {r['mode_ms']} | {r['diff_ms']:+} |"
                for r in s["segments"]]
        out += [f"| {r['stage']} | {r['base_ms']} | {r['mode_ms']} | {r['diff_ms']:+} |"
                for r in s["stages"][:top]]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base")
    ap.add_argument("mode")
    ap.add_argument("--json", default=None)
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args(argv)
    for p in (a.base, a.mode):
        if not Path(p).is_file():
            ap.error(f"{p}: no such file")
    print(json.dumps({"config": {"base": a.base, "mode": a.mode}}))
    result = compare(a.base, a.mode)
    print(table(result, a.top))
    s = result["all"]
    print(json.dumps({"matched": result["matched"],
                      "ttft_diff_ms": s["ttft_diff_ms"] if s else None,
                      "largest": s["stages"][0] if s and s["stages"] else None}))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["matched"] else 1


if __name__ == "__main__":
    sys.exit(main())
