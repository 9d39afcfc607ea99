"""ServerProcess: a port taken between ``free_port()`` and the server's bind is retried."""

import pytest

from sglang_flatcake.commands import server as srv


def test_port_taken_is_seen_in_the_log_for_this_port_only(tmp_path):
    log = tmp_path / "s.log"
    s = srv.ServerProcess(["--model-path", "m"], port=40001, log_path=str(log))
    log.write_text(f"ERROR: [Errno 98] {srv.BIND_FAILED} ('127.0.0.1', 40002): address already in use\n")
    assert not s._port_taken()
    log.write_text(f"ERROR: [Errno 98] {srv.BIND_FAILED} ('127.0.0.1', 40001): address already in use\n")
    assert s._port_taken()


def test_start_retries_on_a_new_port(tmp_path, monkeypatch):
    s = srv.ServerProcess(["--model-path", "m"], log_path=str(tmp_path / "s.log"))
    first, seen = s.port, []

    def once(timeout, *rest):
        seen.append((s.port, list(s.args)))
        if len(seen) == 1:
            raise srv.PortTaken(s.port)
        return s
    monkeypatch.setattr(s, "_start_once", once)
    monkeypatch.setattr(srv, "free_port", lambda: first + 1 if first < 65000 else first - 1)
    assert s.start() is s
    assert [p for p, _ in seen] == [first, s.port] and s.port != first
    assert seen[1][1][-2:] == ["--port", str(s.port)] and s.url.endswith(f":{s.port}")
    assert s.args.count("--port") == 1


def test_a_fixed_port_taken_is_an_error_naming_it(tmp_path, monkeypatch):
    s = srv.ServerProcess(["--model-path", "m"], port=40003, log_path=str(tmp_path / "s.log"))
    monkeypatch.setattr(s, "_start_once", lambda timeout, *rest: (_ for _ in ()).throw(srv.PortTaken(40003)))
    with pytest.raises(RuntimeError, match="port 40003 already in use"):
        s.start()


def test_startup_stage_names_what_the_start_waits_for():
    assert srv.startup_stage("") == "Python to import SGLang"
    log = "[2026] server_args={'model_path': 'm'}\n"
    assert srv.startup_stage(log).startswith("the scheduler process to start")
    log += "[2026] Init parallel begin.\n[2026] Load weight begin. avail mem=13.56 GB\n"
    assert srv.startup_stage(log) == "the model weights to load"
    log += "[2026] Load weight end. elapsed=0.39 s\n[2026] KV Cache is allocated. #tokens: 16384\n"
    assert srv.startup_stage(log) == "the host pool and the storage backend"
    log += "[2026] INFO:     Uvicorn running on http://127.0.0.1:1 (Press CTRL+C to quit)\n"
    assert srv.startup_stage(log) == "the first request (warm-up)"
    log += "[2026] The server is fired up and ready to roll!\n"
    assert srv.startup_stage(log) == "/health_generate to answer"


def test_start_reports_progress_from_the_log_until_healthy(tmp_path, monkeypatch):
    """The health wait tells ``progress`` the seconds and the stage read from the log."""
    log = tmp_path / "s.log"
    s = srv.ServerProcess(["--model-path", "m"], log_path=str(log))

    class Alive:
        pid, returncode = 0, None

        def poll(self):
            return None
    lines = iter(["server_args=ServerArgs()\n", "Load weight begin\n", "Load weight end\n"])
    monkeypatch.setattr(srv.subprocess, "Popen", lambda *a, **k: Alive())

    def answer(url, timeout):
        with open(log, "a") as f:
            f.write(next(lines, ""))
        if "Load weight end" not in log.read_text():
            raise ConnectionRefusedError()
        return _Ok()
    monkeypatch.setattr(srv.urllib.request, "urlopen", answer)
    monkeypatch.setattr(srv, "wait_until", _fast_wait_until)
    seen = []
    assert s.start(progress=lambda t, stage: seen.append((t, stage))) is s
    stages = [stage for _, stage in seen]
    assert stages[0] == "Python to import SGLang" and "the model weights to load" in stages
    assert all(t >= 0 for t, _ in seen) and [t for t, _ in seen] == sorted(t for t, _ in seen)


class _Ok:
    status = 200

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _fast_wait_until(cond, timeout, what, every=0.25):
    for _ in range(50):
        got = cond()
        if got:
            return got
    raise TimeoutError(what)


def test_a_second_start_of_a_running_server_is_refused(tmp_path, monkeypatch):
    """``with ServerProcess(...).start() as s`` starts twice (``__enter__`` starts too): the
    first process would run on with nobody to stop it (a test fixture leaked two spinning
    servers into CI's run that way).  The second start is refused, naming the running pid."""
    import subprocess
    import sys
    s = srv.ServerProcess(["--model-path", "m"], log_path=str(tmp_path / "log"))
    started = []

    def once(timeout, *rest):
        s.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                  start_new_session=True)
        started.append(s.proc)
        return s
    monkeypatch.setattr(s, "_start_once", once)
    try:
        with pytest.raises(RuntimeError, match=f"already running \\(pid {s.start().proc.pid}\\)"):
            with s:
                pass
        assert len(started) == 1
    finally:
        s.stop()
    assert started[0].poll() is not None
