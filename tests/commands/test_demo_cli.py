"""``flatcake demo`` and the ``flatcake`` command as a person meets them: help that is true,
progress while it waits, a closing sentence, Ctrl-C as one line and exit code 130, and a
store directory that is a file named as such."""

from __future__ import annotations

import io
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sglang_flatcake.commands import cli, demo, interrupts
from sglang_flatcake.commands.demo_report import Progress, closing_sentence


def flatcake(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_flatcake", *args],
                          capture_output=True, text=True, timeout=timeout, **kw)


def test_help_says_the_demo_uses_its_own_client_not_bench_serving():
    top = flatcake("--help")
    assert top.returncode == 0
    assert "bench_serving" not in top.stdout and "its own client" in top.stdout
    assert "simulated serving clock" in top.stdout              # replay is not a real server
    d = flatcake("demo", "--help")
    assert d.returncode == 0 and "bench_serving" not in d.stdout
    assert "tokens per KV page" in d.stdout and "--flatcake-* flags" in d.stdout


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(demo, "run", interrupted)
    assert cli.main(["demo"]) == 130
    err = capsys.readouterr().err
    assert err == "flatcake demo: interrupted; the servers it started are stopped\n"


def test_ctrl_c_inside_a_print_still_ends_on_a_line_of_its_own(monkeypatch, capsys):
    """A Ctrl-C between a print's text and its newline (seen with the model build's line):
    the closing words start a new line instead of finishing the half one."""
    def interrupted(args):
        print("[demo] building a tiny random Llama", end="", file=sys.stderr)
        raise KeyboardInterrupt
    monkeypatch.setattr(demo, "run", interrupted)
    assert cli.main(["demo"]) == 130
    err = capsys.readouterr().err
    assert err.splitlines() == ["[demo] building a tiny random Llama",
                                "flatcake demo: interrupted; the servers it started are stopped"]
    assert sys.stderr is not None and not isinstance(sys.stderr, interrupts.LineEnds)


def test_run_backend_stops_the_server_when_interrupted(monkeypatch, tmp_path):
    """A Ctrl-C while the server starts goes up through ``run_backend``'s ``finally``."""
    from sglang_flatcake.commands import server as srv
    stopped = []

    def start(self, *a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(srv.ServerProcess, "start", start)
    monkeypatch.setattr(srv.ServerProcess, "stop", lambda self: stopped.append(self.url))
    args = cli._parse(["demo", "--store-dir", str(tmp_path / "s")])
    with pytest.raises(KeyboardInterrupt):
        demo.run_backend(args, "flatcake", "m", [], tmp_path)
    assert len(stopped) == 1


def server_pids(marker: str) -> list[int]:
    """Processes whose command line names ``marker`` (the demo's store path)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if marker in (p / "cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(p.name))
            except OSError:
                continue                     # it ended while we looked
    return out


def default_sigint() -> None:
    """``preexec_fn``: SIGINT as a terminal's foreground job has it.  A test run started as a
    background job of a non-interactive shell (``python -m pytest -q &``) has SIGINT ignored,
    every process it starts inherits that, and Python keeps it: the demo under test would
    carry on through the test's Ctrl-C (issue 33)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_the_demo_under_test_takes_sigint_even_where_the_test_run_ignores_it():
    probe = [sys.executable, "-c", "import signal; h = signal.getsignal(signal.SIGINT); "
             "print('ignored' if h == signal.SIG_IGN else 'Ctrl-C' "
             "if h is signal.default_int_handler else h)"]
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)        # as under ``pytest &``
    try:
        inherited = subprocess.run(probe, capture_output=True, text=True).stdout.strip()
        reset = subprocess.run(probe, capture_output=True, text=True,
                               preexec_fn=default_sigint).stdout.strip()
    finally:
        signal.signal(signal.SIGINT, old)
    assert (inherited, reset) == ("ignored", "Ctrl-C")


# The stages of the demo's start a Ctrl-C is sent in: what the server's log shows once the
# stage has begun (None: the demo builds its model, no server yet) and the stage that the
# log then says the start waits for (server.startup_stage).
CTRL_C_STAGES = {
    "model build": (None, None),
    "importing SGLang": ("", "Python to import SGLang"),
    "scheduler start": ("server_args=", "the scheduler process to start (it imports SGLang "
                                        "again)"),
    "warm-up": ("Uvicorn running on", "the first request (warm-up)"),
}
STOP_BOUND_S = 20.0         # from the Ctrl-C to the demo's exit, under full CPU load


@pytest.fixture(scope="module")
def demo_models(tmp_path_factory):
    """One model cache for the stages after the model build (built by the first of them)."""
    return tmp_path_factory.mktemp("demo-models")


def _read_until(proc, what: bytes, err: bytes, deadline: float) -> bytes:
    while what not in err and time.time() < deadline:
        if select.select([proc.stderr], [], [], 0.05)[0]:
            chunk = os.read(proc.stderr.fileno(), 4096)
            if not chunk:
                break
            err += chunk
    assert what in err, err.decode(errors="replace")[-2000:]
    return err


def _wait_for(cond, deadline: float, what: str):
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _server_group(store: Path, demo_pid: int) -> int | None:
    """The process group of the server the demo launched (its own session, led by the
    ``sglang.launch_server`` process that names the store), once there is one."""
    for pid in server_pids(str(store)):
        try:
            if pid != demo_pid and os.getsid(pid) == pid:
                return pid
        except ProcessLookupError:
            continue
    return None


@pytest.mark.e2e
@pytest.mark.parametrize("stage", list(CTRL_C_STAGES))
def test_ctrl_c_at_each_stage_of_the_start_stops_the_demo_and_its_server(stage, tmp_path,
                                                                         demo_models):
    """The real command, Ctrl-C at a named stage: the server (once there is one) is paused
    with SIGSTOP as soon as its log shows the stage, so the signal lands in that stage and
    no later; CPU-bound loops on every core from the signal to the exit.  Exit 130 within
    ``STOP_BOUND_S``, one line and no traceback, and no process left of the server's group
    or with the demo's store directory on its command line."""
    pytest.importorskip("sglang.srt.server_args")
    pytest.importorskip("transformers")
    from sglang_flatcake.commands.processes import running_in_group
    from sglang_flatcake.commands.server import startup_stage
    marker, want = CTRL_C_STAGES[stage]
    store = tmp_path / "ctrl-c-store"
    models = tmp_path / "models" if marker is None else demo_models
    env = {**os.environ, "FLATCAKE_DEMO_CACHE": str(models)}
    proc = subprocess.Popen([sys.executable, "-m", "sglang_flatcake", "demo", "--num-requests",
                             "1", "--passes", "1", "--store-dir", str(store)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            preexec_fn=default_sigint)
    deadline, pgid, loaders = time.time() + 600, None, []
    try:
        if marker is None:
            err = _read_until(proc, b"building a tiny random Llama", b"", deadline)
        else:
            err = _read_until(proc, b"starting sglang.launch_server (log: ", b"", deadline)
            err = _read_until(proc, b")\n", err, deadline)
            log = Path(re.search(rb"starting sglang\.launch_server \(log: ([^)]+)\)",
                                 err)[1].decode())
            pgid = _wait_for(lambda: _server_group(store, proc.pid), deadline, "the server")
            _wait_for(lambda: log.exists() and marker in log.read_text(errors="replace"),
                      deadline, f"{marker!r} in {log}")
            os.killpg(pgid, signal.SIGSTOP)
            assert startup_stage(log.read_text(errors="replace")) == want, \
                "the start went past the stage before the test paused it"
        loaders = [subprocess.Popen(["sh", "-c", "while :; do :; done"])
                   for _ in range(os.cpu_count() or 2)]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, rest = proc.communicate(timeout=180)
        took = time.monotonic() - t0
        text = (err + rest).decode(errors="replace")
        assert proc.returncode == 130, text[-2000:]
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-2000:]
        assert text.strip().splitlines()[-1] == \
            "flatcake demo: interrupted; the servers it started are stopped"
        assert took < STOP_BOUND_S, f"the demo took {took:.1f}s to stop"
        assert server_pids(str(store)) == []
        assert pgid is None or running_in_group(pgid) == [], "a process of the server's group runs"
        print(f"{stage}: exit 130 {took:.1f}s after the Ctrl-C")
    finally:
        for p in loaders:
            p.kill()
            p.wait()
        if proc.poll() is None:
            proc.kill()
        if pgid is not None and running_in_group(pgid):
            os.killpg(pgid, signal.SIGKILL)


def test_progress_redraws_on_a_terminal_and_writes_spaced_lines_otherwise():
    now = [0.0]
    log = io.StringIO()
    p = Progress(log, every_s=10, tty=False, clock=lambda: now[0])
    for t in (0, 1, 5, 10, 12, 21):
        now[0] = t
        p.update(f"at {t}")
    p.done("finished")
    assert log.getvalue().splitlines() == ["at 0", "at 10", "at 21", "finished"]
    term = io.StringIO()
    q = Progress(term, tty=True, clock=lambda: now[0])
    q.update("a")
    now[0] += 1
    q.update("b")
    q.done("c")
    assert term.getvalue() == "\ra\x1b[K\rb\x1b[K\rc\x1b[K\n"


ROW = {"backend": "flatcake", "requests_sent": 64, "requests_served": 64, "prompt_tokens": 1000,
       "storage_tokens": 250, "backup_tokens": 900, "ttft_s_mean": 0.1234}


def test_closing_sentence_says_it_succeeded_what_it_measured_and_where_it_went():
    s = closing_sentence([ROW], 2, 32, ["Rows (JSON): r.json.", "Logs and stores: /w"])
    assert s.startswith("flatcake demo: OK.")
    assert "all 64 requests (32 x 2 passes)" in s and "250 prompt tokens came back" in s
    assert "(25% of all prompt tokens)" in s and "900 were written" in s and "0.123 s" in s
    assert s.endswith("Rows (JSON): r.json. Logs and stores: /w") and "\n" not in s
    two = closing_sentence([{**ROW, "backend": "none", "storage_tokens": 0}, ROW], 2, 32, [])
    assert "Each of 2 backends" in two and "none 0, flatcake 250" in two


def test_the_linker_says_what_it_recomputed_and_the_rates_it_priced_it_with():
    from sglang_flatcake.commands.demo_report import decision_line
    gauges = {"flatcake_linker_decision_recompute_when_faster": 1.0,
              "flatcake_linker_decision_restored_requests": 3.0,
              "flatcake_linker_decision_recomputed_requests": 5.0,
              "flatcake_linker_decision_recomputed_tokens": 4096.0,
              "flatcake_linker_decision_prefill_tokens_per_s": 36000.0,
              "flatcake_linker_decision_restore_bytes_per_s": 512.0 * 2**20}
    line = decision_line(gauges)
    assert "3 requests restored from SSD, 5 recomputed instead (4096 tokens)" in line
    assert "prefill 36,000 tokens/s, restore 512 MiB/s" in line
    margin = decision_line({**gauges, "flatcake_linker_decision_prefill_marginal_s_per_token":
                            9.5e-6})
    assert "36,000 tokens/s, 9.5 us a recomputed token at the margin, restore" in margin
    assert "off" in decision_line({**gauges, "flatcake_linker_decision_recompute_when_faster": 0})
    assert "no decision exported" in decision_line({})
    row = {**ROW, "backend": "flatcake-linker", "restored_tokens": 0, "flatcake": gauges}
    s = closing_sentence([row], 1, 32, [])
    assert "0 prompt tokens came back" in s and "5 requests recomputed their SSD part" in s
    assert "recomputed" not in closing_sentence([{**row, "flatcake": {}}], 1, 32, [])


def test_a_store_dir_that_is_a_file_is_named_as_a_file(tmp_path, layout, config):
    from sglang_flatcake.private_fs import private_dir
    from sglang_flatcake.store import FlatCakeStore
    f = tmp_path / "store"
    f.write_text("")
    with pytest.raises(NotADirectoryError, match="regular file, not a directory") as e:
        private_dir(f)
    assert "another local user" not in str(e.value) and str(f) in str(e.value)
    with pytest.raises(NotADirectoryError, match="regular file, not a directory"):
        FlatCakeStore(f, layout, config)
    assert f.read_text() == "", "the file is left as it was"


def test_progress_close_ends_an_open_terminal_line_only():
    term = io.StringIO()
    p = Progress(term, tty=True)
    p.close()
    assert term.getvalue() == ""
    p.update("starting")
    p.close()
    p.close()
    assert term.getvalue() == "\rstarting\x1b[K\n"


@pytest.mark.e2e
def test_the_demo_shows_progress_and_ends_saying_what_it_measured(tmp_path):
    """The real demo at a small scale, as a log sees it: the start's stages, requests answered
    of sent, no tokenizer progress bars, and a closing sentence naming the JSON."""
    pytest.importorskip("sglang.srt.server_args")
    out = tmp_path / "demo.json"
    r = flatcake("demo", "--num-requests", "2", "--passes", "2", "--json", str(out),
                 "--store-dir", str(tmp_path / "store"), timeout=1500,
                 env={**os.environ, "FLATCAKE_DEMO_CACHE": str(tmp_path / "models")})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "server starting" in r.stderr and "waiting for" in r.stderr
    assert "pass 2/2: 2 of 2 requests served" in r.stderr
    assert "Compute merges" not in r.stderr and "Traceback" not in r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith(f"flatcake demo: OK. A real SGLang server with the "
                           f"{demo.DEFAULT_BACKEND} backend served all 4 requests (2 x 2 "
                           f"passes)"), last
    assert f"Rows (JSON): {out}." in last and out.is_file()


def test_a_model_cache_that_cannot_be_used_is_one_line(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FLATCAKE_DEMO_CACHE", str(blocker))
    with pytest.raises(demo.DemoFailure, match=f"the model cache {blocker} cannot be used: .*"
                       "regular file, not a directory.*FLATCAKE_DEMO_CACHE"):
        demo.tiny_model(4096)
