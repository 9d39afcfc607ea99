"""End to end on CPU: real ``sglang.launch_server`` processes with ``FlatCakeLinker`` as
SGLang's direct external linker (no HiCache, no host pool).

One server writes two prompts through the linker (their first answers are computed from
scratch: the uncached reference); each test starts a new server on a copy of that store, so
every hit is a real load from the store into device slots no earlier request filled (the
trap of flush-and-repeat: the slots may still hold the right KV).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error

import numpy as np
import pytest

pytest.importorskip("sglang.srt.mem_cache.unified_cache.unified_cache_linker")
pytest.importorskip("transformers")

from sglang_flatcake.commands.processes import wait_until  # noqa: E402
from sglang_flatcake.commands.server import ServerProcess, cpu_server_args  # noqa: E402
from sglang_flatcake.commands.server_calls import (  # noqa: E402
    cached_tokens, generate, logprobs, prompt_ids, stored_blocks)
from sglang_flatcake.commands.tiny_model import build_tiny_llama  # noqa: E402
from sglang_flatcake.segment import COMMIT_DELAY_ENV  # noqa: E402
from sglang_flatcake.store import FlatCakeStore  # noqa: E402

pytestmark = pytest.mark.e2e
PAGE = 16


def linker_args(model: str, store_dir, **extra) -> list[str]:
    return cpu_server_args(model, str(store_dir), PAGE, backend="flatcake-linker",
                           extra_config=extra)


def from_linker(resp) -> int:
    """Prompt tokens SGLang credits to the linker (it reports linker hits as ``host``)."""
    return cached_tokens(resp, "host")


def rank_store(store_dir):
    (manifest,) = list(store_dir.rglob("flatcake.json"))
    return manifest.parent


def page_keys(ids) -> list[str]:
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    n = len(ids) // PAGE * PAGE
    return get_storage_hash_str(RadixKey(ids[:n]), None, page_size=PAGE)


A, B = prompt_ids(640, 1), prompt_ids(480, 2)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))


@pytest.fixture(scope="module")
def written(model, tmp_path_factory):
    """A store holding A and B, written by a linker server; the uncached answers."""
    d = tmp_path_factory.mktemp("written")
    store = d / "store"
    with ServerProcess(linker_args(model, store), log_path=str(d / "s1.log")) as s:
        ref = {"a": generate(s, A), "b": generate(s, B)}
        assert from_linker(ref["a"]) == 0 and from_linker(ref["b"]) == 0
        want = len(A) // PAGE + len(B) // PAGE
        wait_until(lambda: stored_blocks(store) >= want, 120, "A and B to be stored")
    return store, ref


def copy_store(written, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(written[0], store)
    return store


def test_restart_serves_the_prompt_from_the_linker_into_poisoned_slots(model, written, tmp_path):
    """A new server on the stored KV: the prompt's KV is loaded into slots filled with NaN
    first (``FLATCAKE_TEST_POISON_LOAD_SLOTS``): any page the load missed would show."""
    store = copy_store(written, tmp_path)
    env = {"FLATCAKE_TEST_POISON_LOAD_SLOTS": "1"}
    log = tmp_path / "s2.log"
    with ServerProcess(linker_args(model, store), log_path=str(log), env=env) as s:
        got = generate(s, A)
    assert from_linker(got) >= len(A) - 2 * PAGE, got["meta_info"]
    assert np.allclose(logprobs(got), logprobs(written[1]["a"]), atol=1e-4, rtol=0)
    text = log.read_text()
    assert "flatcake linker: store" in text and "test hooks set" in text


def flip_page(store_dir, keys, page: int) -> None:
    st = FlatCakeStore.open_existing(rank_store(store_dir))
    try:
        plan = st.plan(keys[page:page + 1])
    finally:
        st.close()
    cmd = plan.commands[int(plan.piece_cmd[0])]
    off = cmd.offset + int(plan.piece_offset[0]) + 5
    with open(cmd.path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))


def test_flipped_bytes_are_never_served_and_the_next_try_recomputes(model, written, tmp_path):
    store = copy_store(written, tmp_path)
    keys = page_keys(B)
    flip_page(store, keys, 10)
    log = tmp_path / "s3.log"
    with ServerProcess(linker_args(model, store), log_path=str(log)) as s:
        with pytest.raises(urllib.error.HTTPError) as e:    # the load fails mid-forward
            generate(s, B)
        assert e.value.code == 503
        again = generate(s, B)
    assert np.allclose(logprobs(again), logprobs(written[1]["b"]), atol=1e-4, rtol=0)
    assert from_linker(again) == 10 * PAGE, again["meta_info"]   # cut before the damage
    assert "checksum failed for 1 pages" in log.read_text()


def test_a_bad_linker_extra_config_value_stops_the_launch_with_one_line(model, tmp_path):
    args = linker_args(model, tmp_path / "store", high_watermark=1.7)
    r = subprocess.run([sys.executable, "-m", "sglang.launch_server", *args,
                        "--port", "1"], capture_output=True, text=True, timeout=600,
                       env={**os.environ})
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert lines[-1].startswith("error: linker_extra_config.high_watermark=1.7 is not allowed"), \
        r.stderr[-3000:]
    assert "Traceback" not in r.stderr


START_S = 1200      # a start has taken over 600 s on the shared 2-core machine under load
PENDING = re.compile(r"segment of (\d+) blocks at \S+: data written, header in ([\d.]+)s")


def test_kill_9_while_offloading_then_restart_gives_the_same_answers(model, tmp_path):
    """``kill -9`` of the server's process group while a segment is half committed (its
    data written, its header not: ``FLATCAKE_TEST_SSD_WRITE_DELAY_S_PER_MIB`` holds the
    writer there and logs it) and another offload is queued behind it.  A new server on the
    same store recovers it: the committed prompt P0 is served from the linker into poisoned
    slots, the torn tail of P1 (which extends P0) and the never-written P2 are recomputed,
    and every answer has the logprobs of the first, uncached one."""
    p0 = prompt_ids(160, 41)                      # 10 pages: 0.08 MiB, held 8 s
    p1 = p0 + prompt_ids(960, 42)                 # 60 more: 0.47 MiB, held 47 s
    p2 = prompt_ids(320, 43)
    store, log1, log2 = tmp_path / "store", tmp_path / "s1.log", tmp_path / "s2.log"
    args = linker_args(model, store, memory_bytes=0)          # every page to the SSD
    s = ServerProcess(args, log_path=str(log1), env={COMMIT_DELAY_ENV: "100"})
    s.start(timeout=START_S)
    try:
        first = {"p0": generate(s, p0)}
        wait_until(lambda: stored_blocks(store) >= len(p0) // PAGE, 120, "P0 to be stored")
        before = len(PENDING.findall(log1.read_text()))
        kept = stored_blocks(store)                 # P0's pages (and the warm-up's, if any)
        first["p1"] = generate(s, p1)
        held = wait_until(lambda: PENDING.findall(log1.read_text())[before:], 120,
                          "P1's segment data to be written")
        seen = time.monotonic()
        first["p2"] = generate(s, p2)             # its offload queues behind P1's
        pending = PENDING.findall(log1.read_text())
        assert held[0][0] == str(len(p1) // PAGE - len(p0) // PAGE), held
        assert len(pending) == before + 1, pending          # P2 not written yet
        assert time.monotonic() - seen < 0.5 * float(held[0][1]), held   # P1 still torn
    finally:
        os.killpg(s.proc.pid, signal.SIGKILL)
        s.proc.wait(timeout=60)
    assert all(from_linker(r) == 0 for r in first.values())
    assert stored_blocks(store) == kept, PENDING.findall(log1.read_text())   # P1 torn, P2 unwritten
    env = {"FLATCAKE_TEST_POISON_LOAD_SLOTS": "1"}
    s = ServerProcess(args, log_path=str(log2), env=env)
    try:
        s.start(timeout=START_S)
        again = {"p1": generate(s, p1), "p2": generate(s, p2), "p0": generate(s, p0)}
    finally:
        s.stop()
    assert from_linker(again["p1"]) == len(p0), again["p1"]["meta_info"]   # not the torn tail
    assert from_linker(again["p2"]) == 0, again["p2"]["meta_info"]
    for k in first:
        assert np.allclose(logprobs(again[k]), logprobs(first[k]), atol=1e-4, rtol=0), k
    opened = [x for x in log2.read_text().splitlines() if "flatcake linker: store" in x]
    assert opened and f"'blocks': {kept}" in opened[0], opened
