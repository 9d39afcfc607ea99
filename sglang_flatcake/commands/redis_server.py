"""A redis-server (the cluster's page directory) on a free loopback port, for the cluster
demo and the tests: no persistence, its own process group, stopped with the group."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from . import interrupts
from .processes import Managed, wait_until
from .server import free_port


class RedisServer(Managed):
    grace = 10.0

    def __init__(self, workdir: str | Path, bind: str = "127.0.0.1") -> None:
        self.workdir, self.bind = Path(workdir), bind
        self.port = free_port()
        self.url = f"redis://{bind}:{self.port}/0"

    def start(self, timeout: float = 30) -> "RedisServer":
        """Start it and wait for PING; ``RuntimeError`` when redis-server is missing or exits.
        A start that fails or is interrupted stops the redis-server it launched."""
        import redis
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install "
                               "redis-server)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / "redis.log", "ab")
        client = redis.Redis.from_url(self.url, socket_timeout=0.5)

        def answers() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} "
                                   f"(log: {self.workdir / 'redis.log'})")
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False                 # not listening yet
        try:
            with interrupts.held():          # a Ctrl-C comes once self.proc names it
                self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind",
                                              self.bind, "--save", "", "--appendonly", "no",
                                              "--dir", str(self.workdir)], stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)
            wait_until(answers, timeout, "redis-server to answer PING", every=0.05)
        except BaseException:                # a timeout or a Ctrl-C: not left running
            self.stop()
            raise
        finally:
            client.close()
        return self
