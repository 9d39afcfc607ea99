"""Issue 32, findings "a grant's bytes are readable by any Transfer Engine peer" and "the
grant reply names the slot": whatever the owner's Transfer Engine serves while a grant lasts
is ciphertext under a key only the grant's two nodes derive, and a requester opens every block
with that key (a tampered, moved or foreign block is refused)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed")
pytest.importorskip("zmq", reason="pyzmq not installed")
pytest.importorskip("cryptography", reason="pyca cryptography not installed")

from tests.support.cluster_owner import (attacker, empty, expected, layout, secret,  # noqa: E402,F401
                                         served)

from sglang_flatcake.cluster.requester import RemoteReader  # noqa: E402
from sglang_flatcake.cluster.transfer import Engine  # noqa: E402

SECRET = secret()


@pytest.mark.parametrize("tier", ["ssd", "memory"])
def test_what_the_engine_serves_during_a_grant_is_ciphertext(served, attacker, tier):
    engine, svc, _, ssd, mem = served
    keys, tenant = (ssd, "") if tier == "ssd" else (mem, "alice")
    member = Engine("127.0.0.1")
    stolen = []

    def snoop(grant):           # the grant names the slot; an engine peer reads it meanwhile
        _, addr, n = grant["segments"][0]
        buf = np.zeros(n, np.uint8)
        r = attacker.read(grant["peer"], [buf.ctypes.data], [addr], [n], 1.0)
        stolen.append((r.ok, buf))
    try:
        out = empty(8)
        r = RemoteReader(member, layout(), SECRET, timeout_s=1.0).fetch(
            svc.endpoint, tenant, keys, out, on_grant=snoop)
        assert (r.hits, r.reason) == (8, "")
        np.testing.assert_array_equal(out, expected(keys))     # the member got plaintext
        (ok, got), = stolen
        assert ok and got.any()                                 # the attacker got bytes ...
        raw = got.tobytes()
        plain = expected(keys)
        for i in range(8):                                      # ... none of them plaintext
            assert plain[i, 0, :64].tobytes() not in raw, i
            assert plain[i].tobytes() not in raw, i
    finally:
        member.close()


def test_a_grant_opens_only_with_its_own_key():
    from sglang_flatcake.cluster.seal import grant_cipher, open_block, seal_block, sealed_bytes
    lay = layout()
    plain = np.random.default_rng(1).integers(
        0, 256, (2, lay.layers, lay.block_layer_bytes), np.uint8)
    aead = grant_cipher(SECRET, 1, 0, "ab" * 16)           # node 1 asked node 0
    sealed = np.zeros((2, sealed_bytes(lay.block_bytes)), np.uint8)
    for i in range(2):
        seal_block(aead, i, "tag", f"k{i}", plain[i], sealed[i])
    out = np.zeros_like(plain[0])
    assert open_block(aead, 0, "tag", "k0", sealed[0], out)
    np.testing.assert_array_equal(out, plain[0])
    others = [grant_cipher(SECRET, 1, 2, "ab" * 16),                  # another owner
              grant_cipher(SECRET, 1, 0, "cd" * 16),                  # another request
              grant_cipher(secret(2), 2, 0, "ab" * 16)]               # another requester
    assert not any(open_block(o, 0, "tag", "k0", sealed[0], out) for o in others)
    assert not open_block(aead, 1, "tag", "k0", sealed[0], out)     # moved to another place
    assert not open_block(aead, 0, "tag", "k1", sealed[0], out)     # named as another page
    assert not open_block(aead, 0, "other", "k0", sealed[0], out)   # another tenant's
    sealed[1, 5] ^= 1
    assert not open_block(aead, 1, "tag", "k1", sealed[1], out)     # one bit flipped


def test_records_are_checked_for_blocks_from_disk_not_from_the_arena(served):
    """The owner names the blocks it sealed straight from its host arena (``memory``): their
    AEAD tag covers them from there on, so only disk blocks are hashed against the writer's
    records (an SSD block corrupt at rest is still a ``checksum`` miss)."""
    _, svc, _, ssd, mem = served
    member = Engine("127.0.0.1")

    def spoil(grant):
        seen.append(list(grant["memory"]))
        grant["records"][:] = ["00" * 16] * len(grant["records"])
    try:
        for keys, tenant, memory, hits in ((mem, "alice", list(range(8)), 8), (ssd, "", [], 0)):
            seen, out = [], empty(8)
            r = RemoteReader(member, layout(), SECRET, timeout_s=1.0).fetch(
                svc.endpoint, tenant, keys, out, on_grant=spoil)
            assert seen == [memory] and r.hits == hits, (r, seen)
            assert (out == (expected(keys) if hits else 0)).all()
        from sglang_flatcake.cluster.wire import grant_fields
        g = {"hits": 1, "bytes": 1, "segments": [[0, 1, 1]], "records": ["r"], "lease": "l",
             "peer": "p"}
        assert grant_fields(g, 1, 1)[3] == frozenset()
        assert grant_fields({**g, "memory": [0]}, 1, 1)[3] == {0}
        assert grant_fields({**g, "memory": ["0"]}, 1, 1) is None      # malformed: refused
    finally:
        member.close()
