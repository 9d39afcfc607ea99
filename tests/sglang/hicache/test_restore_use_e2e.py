"""A real CPU server, a concurrent multi-turn run twice with a flush between: every restored
token is accounted for (used by its request, or evicted before use, or departed), the counters
in ``/metrics`` add up, and what SGLang credits to storage is exactly what the ledger calls used."""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("sglang.srt.server_args")
pytest.importorskip("transformers")

from sglang_flatcake.commands.processes import wait_until  # noqa: E402
from sglang_flatcake.commands.server import ServerProcess, cpu_server_args  # noqa: E402
from sglang_flatcake.commands.server_calls import backup_tokens, flush, prometheus  # noqa: E402
from sglang_flatcake.commands.tiny_model import build_tiny_llama  # noqa: E402

pytestmark = pytest.mark.e2e
PAGE = 16
RESTORED = re.compile(r"flatcake: restored (\S+): (\d+) of")
FATE = re.compile(r"flatcake: (\S+) (admitted|departed): used (\d+) of (\d+) restored tokens")
G = "flatcake_direct_restored_tokens_"


def prompts(sessions=4, turns=3):
    """Turn t of a session is turn t-1 plus a reply and a new message (as chat turns are)."""
    rng, out = random.Random(1), []
    for _ in range(sessions):
        p = [rng.randrange(2, 500) for _ in range(rng.randrange(384, 640))]
        for _ in range(turns):
            out.append(list(p))
            p += [rng.randrange(2, 500) for _ in range(256)]
    return out


def send_all(s, ps):
    def one(ids):
        m = s.post("/generate", {"input_ids": ids,
                                 "sampling_params": {"temperature": 0, "max_new_tokens": 4}})
        return (m["meta_info"].get("cached_tokens_details") or {}).get("storage") or 0
    with ThreadPoolExecutor(len(ps)) as ex:
        return sum(ex.map(one, ps))


def test_restored_tokens_add_up_to_used_plus_unused(tmp_path):
    model = str(build_tiny_llama(tmp_path / "tiny-llama"))
    args = cpu_server_args(model, str(tmp_path / "store"), PAGE, max_total_tokens=4096,
                           extra=["--enable-metrics", "--schedule-policy", "fcfs"])
    log_path = tmp_path / "s.log"
    ps = prompts()
    with ServerProcess(args, log_path=str(log_path)) as s:
        credited = send_all(s, ps)
        backup_tokens(s)
        flush(s)
        credited += send_all(s, ps)
        probe = {"input_ids": [3] * PAGE, "sampling_params": {"max_new_tokens": 1}}

        def settled():             # each step exports the counters; the last span settles late
            s.post("/generate", probe)
            m = prometheus(s, G)
            return m.get(G + "published", 0) > 0 and m.get(G + "pending", 1) == 0
        wait_until(settled, 60, "every restored span settled in /metrics")
        m = prometheus(s, G)
    log = log_path.read_text(errors="replace")
    restored = sum(int(x[2]) for x in RESTORED.finditer(log))
    fates = [(how, int(u), int(n)) for _, how, u, n in FATE.findall(log)]
    assert restored > 0 and fates
    # the log: every restored token settles once, as used or not
    assert sum(n for *_, n in fates) == restored
    used = sum(u for _, u, _ in fates)
    # /metrics: the same totals, and they add up
    assert m[G + "published"] == restored and m[G + "used"] == used
    assert m[G + "published"] == (m[G + "used"] + m[G + "evicted_before_use"]
                                  + m[G + "departed"] + m[G + "pending"])
    # SGLang's cached_tokens_details.storage is what the ledger calls used (nothing lost)
    assert credited == m[G + "used"] - m[G + "used_not_credited"]
    assert m[G + "used_not_credited"] == 0
