"""``flatcake verify`` against real CPU SGLang servers in both modes (HiCache mode with the
flatcake backend, the linker): a restored hit with the same answer and exit 0 after
``--allow-flush``; without it only a device hit (exit 4); a server without flatcake (exit 3)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("sglang.srt.mem_cache.unified_cache.unified_cache_linker")
pytest.importorskip("transformers")

from sglang_flatcake.commands import verify as v  # noqa: E402
from sglang_flatcake.commands.server import ServerProcess, cpu_server_args  # noqa: E402

from tests.support.servers import PAGE  # noqa: E402

pytestmark = pytest.mark.e2e
BACKENDS = {"hicache": "flatcake", "linker": "flatcake-linker"}


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def server(request, model, tmp_path_factory):
    mode = request.param
    work = tmp_path_factory.mktemp(f"verify-{mode}")
    args = cpu_server_args(model, str(work / "store"), PAGE, backend=BACKENDS[mode],
                           extra=["--enable-metrics"])
    with ServerProcess(args, log_path=str(work / "server.log")) as s:   # __enter__ starts it
        yield mode, s


def flatcake_verify(*args: str) -> tuple[int, dict]:
    r = subprocess.run([sys.executable, "-m", "sglang_flatcake", "verify", "--json", *args],
                       capture_output=True, text=True, timeout=300)
    assert r.stdout.strip(), r.stderr
    return r.returncode, json.loads(r.stdout.strip().splitlines()[-1])


def test_restored_hit_same_answer(server):
    mode, s = server
    rc, rep = flatcake_verify("--url", s.url, "--allow-flush", "--tokens", "96")
    assert (rc, rep["verdict"], rep["mode"]) == (0, "restored", mode), rep
    assert rep["flushed"] and rep["same_tokens"]
    # every full page of the prompt but the last came from flatcake, none from the device
    assert rep["restored_tokens"] >= 96 - 2 * PAGE and rep["device_tokens"] == 0, rep
    assert rep["logprob_max_diff"] <= 1e-3 and rep["top_logprob_max_diff"] <= 1e-3
    reads = rep["tier_blocks_read"]          # the server runs with --enable-metrics
    assert reads and sum(reads.values()) >= rep["restored_tokens"] // PAGE, rep


def test_without_flush_only_a_device_hit(server):
    mode, s = server
    rc, rep = flatcake_verify("--url", s.url, "--tokens", "48")
    assert (rc, rep["verdict"], rep["flushed"]) == (4, "not-flushed", False), rep
    assert rep["restored_tokens"] == 0 and rep["device_tokens"] > 0, rep


def test_mode_from_server_info(server):
    mode, s = server
    info = v.server_info(v.RemoteServer(s.url, 30))
    assert v.server_mode(info) == mode
    plain = dict(info, enable_hierarchical_cache=False, enable_unified_cache_external_linker=False)
    assert v.server_mode(plain) == "none"


def test_bad_url_is_one_line():
    r = subprocess.run([sys.executable, "-m", "sglang_flatcake", "verify", "--url", "localhost:1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == ("flatcake: error: --url 'localhost:1': expected "
                                "http://HOST:PORT")
