"""What the demos ask of a running SGLang server over HTTP: ``/metrics`` sums, the backup
count once it has settled, ``/flush_cache`` until accepted; ``DemoFailure`` for a demo that
cannot go on (its message is one line a user can act on)."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

from .processes import wait_until


class DemoFailure(Exception):
    """The demo cannot go on; the message is one line a user can act on."""


def prometheus(server, prefix: str) -> dict[str, float]:
    """Sum of each metric starting with ``prefix`` in the server's /metrics (labels dropped)."""
    out: dict[str, float] = {}
    try:
        text = server.get("/metrics")
    except (urllib.error.URLError, OSError):
        return out
    for line in text.splitlines():
        if line.startswith(prefix):
            name, value = line.rsplit(" ", 1)
            name = name.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def backup_tokens(server, settle_s: float = 3.0, timeout: float = 120.0) -> int:
    """Tokens the server has backed up to storage (``sglang:backuped_tokens_total``), read once
    the count has stopped moving for ``settle_s`` (backups finish after the answers)."""
    name = "sglang:backuped_tokens_total"
    last, since, deadline = None, time.time(), time.time() + timeout
    while time.time() < deadline:
        v = prometheus(server, name).get(name, 0.0)
        if v != last:
            last, since = v, time.time()
        elif time.time() - since >= settle_s:
            break
        time.sleep(0.5)
    return int(last or 0)


def flush(server, timeout: float = 120) -> None:
    """POST /flush_cache until SGLang accepts it (it refuses, HTTP 400, while work is in
    flight); ``DemoFailure`` after ``timeout`` seconds or on any other answer."""
    def accepted() -> bool:
        req = urllib.request.Request(server.url + "/flush_cache", data=b"", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=120):
                return True
        except urllib.error.HTTPError as e:
            if e.code != 400:
                raise DemoFailure(f"/flush_cache answered HTTP {e.code}") from None
            return False
    try:
        wait_until(accepted, timeout, "SGLang to accept /flush_cache", every=1.0)
    except TimeoutError:
        raise DemoFailure(f"/flush_cache refused for {timeout}s: HTTP 400") from None
