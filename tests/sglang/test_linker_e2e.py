"""End to end on CPU: real ``sglang.launch_server`` processes with ``FlatCakeLinker`` as
SGLang's direct external linker (no HiCache, no host pool).

One server writes two prompts through the linker (their first answers are computed from
scratch: the uncached reference); each test starts a new server on a copy of that store, so
every hit is a real load from the store into device slots no earlier request filled (the
trap of flush-and-repeat: the slots may still hold the right KV).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.error

import numpy as np
import pytest

pytest.importorskip("sglang.srt.mem_cache.unified_cache.unified_cache_linker")
pytest.importorskip("transformers")

from sglang_flatcake.commands.processes import wait_until  # noqa: E402
from sglang_flatcake.commands.server import ServerProcess, cpu_server_args  # noqa: E402
from sglang_flatcake.commands.tiny_model import build_tiny_llama  # noqa: E402
from sglang_flatcake.store import FlatCakeStore  # noqa: E402

pytestmark = pytest.mark.e2e
PAGE = 16


def linker_args(model: str, store_dir, **extra) -> list[str]:
    return cpu_server_args(model, str(store_dir), PAGE, backend="flatcake-linker",
                           extra_config=extra)


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(2, 400, size=n)]


def generate(server, ids, new_tokens=4):
    return server.post("/generate", {
        "input_ids": ids, "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}})


def logprobs(resp):
    return np.array([t[0] for t in resp["meta_info"]["output_token_logprobs"]])


def from_linker(resp) -> int:
    """Prompt tokens SGLang credits to the linker (it reports linker hits as ``host``)."""
    return int((resp["meta_info"].get("cached_tokens_details") or {}).get("host", 0))


def rank_store(store_dir):
    (manifest,) = list(store_dir.rglob("flatcake.json"))
    return manifest.parent


def stored_blocks(store_dir) -> int:
    total = 0
    for manifest in store_dir.rglob("flatcake.json"):
        st = FlatCakeStore.open_existing(manifest.parent)
        total += sum(s.n_blocks for s in st.sessions.values())
        st.close()
    return total


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
