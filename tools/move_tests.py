"""Move flat ``tests/test_*.py`` files into the folder of the package part they test, and
rewrite the imports the flat layout allowed (``conftest``, ``redis_fixture``, ``cu_harness``,
other test modules, ``benchmarks/standin.py``) to ``tests/support``.

    python tools/move_tests.py            # print what it would do
    python tools/move_tests.py --apply    # git mv and rewrite

A file not in ``MAP`` is placed by the first ``sglang_flatcake.<part>`` it imports
(``PART_DIR``); one it cannot place is reported and left where it is.  Anything this does not
rewrite (a helper still imported from another test module) is printed as ``check:``."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MAP = {
    "test_store.py": "store", "test_store_faults.py": "store", "test_store_security.py": "store",
    "test_crash.py": "store", "test_index.py": "store", "test_placement.py": "store",
    "test_config.py": "store", "test_address.py": "store",
    "test_region.py": "tiers", "test_ssd_tier_contract.py": "tiers",
    "test_window.py": "read", "test_planner.py": "read", "test_scatter.py": "read",
    "test_checksum.py": "read", "test_device_path.py": "read", "test_device_edges.py": "read",
    "test_gpu_check.py": "read", "test_device_emulation.py": "read", "test_fence_mutations.py": "read",
    "test_nvrtc.py": "read", "test_real_cuda_modules.py": "read",
    "test_io_engine.py": "io", "test_io_uring.py": "io",
    "test_queues.py": "sched", "test_recompute.py": "sched",
    "test_sglang_backend.py": "sglang", "test_sglang_pages.py": "sglang",
    "test_sglang_scheduling.py": "sglang", "test_sglang_signals.py": "sglang",
    "test_flow_cut.py": "sglang", "test_e2e_server.py": "sglang",
    "test_linker.py": "sglang", "test_linker_config.py": "sglang", "test_linker_e2e.py": "sglang",
    "test_sglang_e2e_metrics.py": "sglang", "test_sglang_hooks.py": "sglang",
    "test_sglang_fallbacks.py": "sglang", "test_cluster_security.py": "cluster",
    "test_cluster_directory.py": "cluster", "test_cluster_node.py": "cluster",
    "test_cluster_transfer.py": "cluster", "test_cluster_e2e.py": "cluster",
    "test_replay_cluster.py": "replay", "test_replay_metrics.py": "replay",
    "test_replay_policy.py": "replay", "test_replay_run.py": "replay",
    "test_replay_systems.py": "replay", "test_replay_traces.py": "replay",
    "test_replay_tune.py": "replay", "test_queue_gap.py": "replay",
    "test_cli.py": "commands", "test_server_process.py": "commands",
    "test_replay_client.py": "commands",
    "test_wheel.py": "project", "test_gpu_only_lines.py": "project",
    "test_docs_links.py": "project", "test_private_reach.py": "project",
}

# sglang_flatcake.<part> -> tests/<dir>, for files MAP does not name
PART_DIR = {"read": "read", "io": "io", "tiers": "tiers", "sched": "sched", "sglang": "sglang",
            "cluster": "cluster", "replay": "replay", "commands": "commands", "store": "store",
            "store_write": "store", "store_open": "store", "store_stats": "store",
            "store_checks": "store", "session_table": "store", "sessions": "store",
            "index": "store", "keys": "store", "placement": "store", "config": "store",
            "recovery": "store", "reclaimer": "store", "segment": "store", "layout": "store",
            "address": "store", "errors": "store"}

# (pattern, replacement) applied to a moved file
REWRITES = [
    (r"^(\s*)from conftest import ", r"\1from tests.support import "),
    (r"^from redis_fixture import free_port, redis_url.*$", "from tests.support import free_port"),
    (r"^from redis_fixture import redis_url.*\n", ""),      # a fixture from tests/conftest.py now
    (r"^(\s*)from redis_fixture import free_port", r"\1from tests.support import free_port"),
    (r"^(\s*)from cu_harness import ", r"\1from tests.support.cuda_harness import "),
    (r"^(\s*)from test_io_engine import ", r"\1from tests.support.engines import "),
    (r"^(\s*)from test_window import ", r"\1from tests.support.window import "),
    (r"^from test_e2e_server import HELP_AND_BAD_FLAG, PAGE, model.*$",
     "from tests.support.servers import HELP_AND_BAD_FLAG, PAGE"),
    (r"^(\s*)sys\.path\.insert\(0, os\.path\.join\(os\.path\.dirname\(__file__\), \"\.\.\", "
     r"\"benchmarks\"\)\)\n(\s*)import standin.*$", r"\1from sglang_flatcake.sglang import standin"),
    (r"Path\(__file__\)\.resolve\(\)\.parents\[1\]", "Path(__file__).resolve().parents[2]"),
    (r"Path\(__file__\)\.resolve\(\)\.parent\.parent", "Path(__file__).resolve().parents[2]"),
]
LEFT = re.compile(r"^\s*(from (conftest|redis_fixture|cu_harness|crash_writer|test_\w+) import"
                  r"|import (standin|queue_gap|gpu_read_path)|sys\.path\.insert)", re.M)


def place(path: Path) -> str | None:
    if path.name in MAP:
        return MAP[path.name]
    m = re.search(r"sglang_flatcake\.(\w+)", path.read_text())
    return PART_DIR.get(m.group(1)) if m else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--apply", action="store_true", help="git mv and rewrite (default: dry run)")
    a = p.parse_args(argv)
    flat = sorted((ROOT / "tests").glob("test_*.py"))
    for f in flat:
        d = place(f)
        if d is None:
            print(f"cannot place {f.relative_to(ROOT)}: name it in tools/move_tests.py MAP")
            continue
        dest = ROOT / "tests" / d / f.name
        print(f"{f.relative_to(ROOT)} -> {dest.relative_to(ROOT)}")
        if not a.apply:
            continue
        if dest.exists():
            print(f"  {dest.relative_to(ROOT)} exists: merge by hand", file=sys.stderr)
            continue
        subprocess.run(["git", "mv", str(f), str(dest)], cwd=ROOT, check=True)
        text = dest.read_text()
        for pat, rep in REWRITES:
            text = re.sub(pat, rep, text, flags=re.M)
        dest.write_text(text)
        for m in LEFT.finditer(text):
            print(f"  check: {dest.relative_to(ROOT)}: {m.group(0).strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
