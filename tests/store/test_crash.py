"""Crash recovery with a real ``kill -9`` of a writing process, at random points."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from sglang_flatcake.store import FlatCakeStore
from tests.support import blocks_for, repo_env
from tests.support.crash_writer import LAYOUT, config_for, turn_keys

def run_and_kill(root: Path, seed: str, known: set, new_acks: int, delay: float,
                 region: str = "") -> set[tuple[int, int]]:
    """Run the writer until it acknowledges ``new_acks`` turns not in ``known``, wait
    ``delay`` more seconds (so the kill lands inside a later write), then ``kill -9`` it."""
    env = repo_env()
    p = subprocess.Popen([sys.executable, "-m", "tests.support.crash_writer", str(root), seed]
                         + ([region] if region else []),
                         stdout=subprocess.PIPE, env=env, text=True)
    acked: set[tuple[int, int]] = set()
    try:
        assert p.stdout.readline().strip() == "READY"
        fresh = 0
        for line in p.stdout:
            _, s, t = line.split()
            acked.add((int(s), int(t)))
            fresh += (int(s), int(t)) not in known
            if fresh >= new_acks:
                break
        time.sleep(delay)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        out, _ = p.communicate(timeout=60)
    for line in out.splitlines():
        if line.startswith("ACK"):
            _, s, t = line.split()
            acked.add((int(s), int(t)))
    return acked


@pytest.mark.slow
@pytest.mark.parametrize("medium", ["dir", "region"])
def test_kill_9_during_writes_loses_no_acknowledged_turn_and_serves_no_wrong_byte(tmp_path, medium):
    rng = random.Random(1234)
    root = tmp_path / "store"
    region = str(tmp_path / "region.bin") if medium == "region" else ""
    seed = "crash"
    acked_all: set[tuple[int, int]] = set()
    rounds_with_new_acks = 0
    scanned = 0
    rounds = 6 if medium == "dir" else 10
    for round_ in range(rounds):
        got = run_and_kill(root, seed, acked_all, rng.randint(1, 12), rng.uniform(0.0, 0.05), region)
        rounds_with_new_acks += bool(got - acked_all)
        acked_all |= got
        with FlatCakeStore(root, LAYOUT, config_for(region)) as st:
            for s in range(3):
                t, complete = 0, []
                while True:
                    prefix, keys = turn_keys(seed, s, t)
                    if st.exists(prefix + keys) < len(prefix) + len(keys):
                        # everything acknowledged must be there
                        assert (s, t) not in acked_all, f"acknowledged turn {(s, t)} lost"
                        break
                    complete = prefix + keys
                    t += 1
                if complete:   # every byte of every complete turn, in one restore
                    out = np.zeros((len(complete), LAYOUT.block_bytes), np.uint8)
                    g = st.get(complete, out)
                    assert g.hits == len(complete) and g.corrupt == 0
                    assert np.array_equal(out, blocks_for(LAYOUT, complete)), f"wrong bytes in {s}"
            # the writer continues the same sessions next round: acknowledged turns are skipped
            # as already stored, so every round both recovers and appends.
            if region:     # the kills landed between checkpoints: recovery used the journal/scan
                scanned = scanned or st.recovery_report.get("scanned_segments", 0)
    assert rounds_with_new_acks == rounds, "the writer makes progress every round"
    if region:
        assert scanned, "some round recovered segments written after the last checkpoint"
