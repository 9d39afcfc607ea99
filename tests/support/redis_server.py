"""A real redis-server on a free loopback port, started and stopped by the test
(``commands.redis_server.RedisServer``); ``tests/conftest.py`` makes ``redis_url`` a fixture
for every test."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture
def redis_url(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server; "
                    ".ci/run installs it)")
    pytest.importorskip("redis", reason="PyPI redis client missing (pip install redis)")
    from sglang_flatcake.commands.redis_server import RedisServer
    with RedisServer(tmp_path / "redis") as server:
        yield server.url


TEST_SECRET = b"flatcake-tests-cluster-secret-0123456789"


@pytest.fixture
def secret_file(tmp_path):
    """A cluster secret file (``TEST_SECRET``, mode 600) for nodes and owner processes."""
    import os
    path = tmp_path / "cluster.secret"
    path.write_bytes(TEST_SECRET + b"\n")
    os.chmod(path, 0o600)
    return str(path)
