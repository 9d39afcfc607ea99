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
