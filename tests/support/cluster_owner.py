"""An owner in the test's own process for the cluster's attack tests: a real FlatCakeStore
on real files with 8 SSD blocks of tenant "" and 8 memory-tier blocks of tenant "alice",
published, served by a real ``OwnerService`` over a real Transfer Engine; plus raw ZeroMQ
senders that play the attacker on the wire."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.cluster_keys import node_secret, write_node_files

OWNER, MEMBER = 0, 1          # the in-process owner's node id, a requester's

LAYOUT_ARGS = dict(layers=4, kv_heads=2, head_dim=64, dtype="bfloat16", page_tokens=16)
BOUND = 1.0


def layout():
    from sglang_flatcake.layout import KVLayout
    return KVLayout.mha(**LAYOUT_ARGS)


def secret(node: int = MEMBER):
    """The cluster secret with node ``node``'s identity (a requester's by default)."""
    return node_secret(node)


def expected(keys):
    from sglang_flatcake.cluster.owner_main import session_blocks
    lay = layout()
    return session_blocks(lay.block_bytes, keys).reshape(len(keys), lay.layers, -1)


def empty(n):
    lay = layout()
    return np.zeros((n, lay.layers, lay.block_layer_bytes), np.uint8)


def send_raw(endpoint, raw: bytes, timeout=BOUND):
    """Send ``raw`` bytes to a REP endpoint; its raw reply, or None."""
    import zmq
    s = zmq.Context.instance().socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send(raw)
        if not s.poll(int(timeout * 1000)):
            return None
        return s.recv()
    finally:
        s.close()


@pytest.fixture
def served(tmp_path):
    """``(engine, service, store, ssd keys, mem keys)`` of an owner in this process."""
    from sglang_flatcake.cluster.owner import OwnerService
    from sglang_flatcake.cluster.owner_main import session_blocks, session_keys
    from sglang_flatcake.cluster.transfer import Engine
    from sglang_flatcake.config import FlatCakeConfig
    from sglang_flatcake.placement import WriteSignals
    from sglang_flatcake.store import FlatCakeStore
    lay = layout()
    cfg = FlatCakeConfig(memory_bytes=16 << 20, ssd_bytes=256 << 20, extent_bytes=1 << 20,
                         durable=False)
    store = FlatCakeStore(tmp_path / "owner", lay, cfg)
    engine = Engine("127.0.0.1")
    svc = OwnerService(store, engine, secret(OWNER), slot_blocks=16)
    ssd, mem = session_keys(8, "ssd"), session_keys(8, "mem")
    store.put(ssd, session_blocks(lay.block_bytes, ssd), signals=WriteSignals(turn=0))
    store.put(mem, session_blocks(lay.block_bytes, mem), signals=WriteSignals(turn=1))
    assert store.stats()["blocks_memory"] == 8 and store.stats()["blocks_ssd"] == 8
    svc.publish("", "s", ssd)
    svc.publish("alice", "m", mem)
    yield engine, svc, store, ssd, mem
    svc.close()
    engine.close()
    store.close()


@pytest.fixture(scope="module")
def attacker():
    """A Transfer Engine with nothing but the owner's engine address: no secret."""
    from sglang_flatcake.cluster.transfer import Engine
    e = Engine("127.0.0.1")
    yield e
    e.close()


def _files(root, node):
    key, roster = write_node_files(f"{root}-keys", node)
    return ["--node-key-file", key, "--roster-file", roster]


class OwnerProcess:
    """An owner node in its own process (``cluster.owner_main``: a real store on real files,
    ``blocks`` SSD blocks of one session) for stall and kill tests."""

    def __init__(self, root, secret_file, blocks=16, node=OWNER):
        import json
        import subprocess
        import sys
        from sglang_flatcake.cluster.owner_main import session_keys
        self.keys = session_keys(blocks, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_flatcake.cluster.owner_main", "--root", str(root),
             "--blocks", str(blocks), "--secret-file", secret_file, "--raw-bytes", "65536",
             "--node", str(node), *_files(root, node)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.info = json.loads(self.proc.stdout.readline())
        self.endpoint = self.info["endpoint"]

    def stop(self):
        import os
        import signal
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()
