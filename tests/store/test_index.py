"""Tests for sglang_flatcake.index (KeyIndex and key fingerprints)."""

from __future__ import annotations

import hashlib
import secrets

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_flatcake import index as index_mod
from sglang_flatcake.index import KeyIndex
from sglang_flatcake.keys import key_digest, key_digests


def hex_key() -> str:
    return secrets.token_hex(32)


def row(key: str) -> np.ndarray:
    return np.frombuffer(key_digest(key), "<u8")


NON_HEX = ["", "abc", "x" * 64, "g" + "0" * 63, "0" * 63, "0" * 65, "日本語のキー",
           "\ud800lone-surrogate", "ab " * 21 + "a", " " + "ab" * 31 + "a", "page:42"]


# ------------------------------------------------------------------ digests


# The key scheme is on-disk format (segment headers, the index): these pin it.  A change
# here needs a new FORMAT_VERSION (old stores are then refused or started fresh).
GOLDEN = [
    ("0" * 64, "00000000000000000000000000000000"),
    ("0" * 63 + "1", "0000000000000000000000000000004f"),
    ("1" + "0" * 63, "10000000000000000000000000000000"),
    ("4f8f1ce47105ac51fec5e01d5ba10fc03f2730ac2677396a36c0f1b21850cd0b",    # sha256(b"flatcake")
     "643337e80f4b45ff5427239767486b7a"),
    ("ab" * 32, "ac42021b334c5e0f6e59806c0ba8f5c0"),
    ("page:42", "7b502f595f3522035b0008ff8922b132"),                       # blake2b
]


def test_key_digests_match_the_golden_vectors_one_by_one_and_in_a_batch():
    for k, want in GOLDEN:
        assert key_digest(k).hex() == want, k
    hexes = [k for k, _ in GOLDEN[:5]]
    assert key_digests(hexes).tobytes().hex() == "".join(w for _, w in GOLDEN[:5])


def test_a_hex_key_digest_folds_in_all_32_bytes():
    """The first 16 bytes alone were the fingerprint once: keys differing past them aliased."""
    k = hex_key()
    raw = bytearray(bytes.fromhex(k))
    for i in (16, 24, 31):                       # a byte of each later half-word changed
        other = bytearray(raw)
        other[i] ^= 0x80
        assert key_digest(other.hex()) != key_digest(k), i
    swapped = (raw[16:] + raw[:16]).hex()
    assert key_digest(swapped) != key_digest(k)


def test_key_digest_non_hex_is_blake2b():
    for k in ["abc", "x" * 64, "0" * 63, "page:42"]:
        assert key_digest(k) == hashlib.blake2b(k.encode(), digest_size=16).digest()
    assert len(key_digest("\ud800")) == 16  # unencodable str still works


def test_hex_keys_are_case_insensitive():
    k = hex_key()
    assert key_digest(k.upper()) == key_digest(k)


def test_key_digest_rejects_non_str():
    with pytest.raises(TypeError):
        key_digest(b"0" * 64)  # type: ignore[arg-type]


@pytest.mark.parametrize("keys", [
    [hex_key() for _ in range(50)],
    list(NON_HEX),
    [hex_key(), "abc", hex_key(), "x" * 64, hex_key().upper()],
    ["a" * 63, "b" * 65],          # misaligned lengths that sum to 128 hex chars
    ["ab" * 31 + " a", "ab" * 32],  # whitespace inside a 64-char key
    [hex_key()[:32] + "zz" + hex_key()[34:]],
    [],
])
def test_key_digests_matches_scalar(keys):
    got = key_digests(keys)
    assert got.dtype == np.uint64 and got.shape == (len(keys), 2)
    assert got.flags.c_contiguous
    for i, k in enumerate(keys):
        np.testing.assert_array_equal(got[i], row(k))


# ------------------------------------------------------------------ round trips


def test_hex_round_trip():
    keys = [hex_key() for _ in range(3000)]
    ix = KeyIndex()
    ix.put_many(keys, np.arange(3000, dtype=np.uint64) * 7)
    assert len(ix) == 3000
    addr, found = ix.lookup(keys)
    assert addr.dtype == np.uint64 and found.dtype == np.bool_
    assert found.all()
    np.testing.assert_array_equal(addr, np.arange(3000, dtype=np.uint64) * 7)
    assert ix.get(keys[123]) == 123 * 7
    assert keys[5] in ix and hex_key() not in ix


def test_non_hex_round_trip_and_scalar_put():
    ix = KeyIndex(8)
    for i, k in enumerate(NON_HEX):
        ix.put(k, i + 1)
    assert len(ix) == len(NON_HEX)
    for i, k in enumerate(NON_HEX):
        assert ix.get(k) == i + 1
    assert ix.get("not there") is None


def test_mixed_batch():
    keys = [hex_key() if i % 3 else f"other-{i}" for i in range(500)]
    ix = KeyIndex()
    ix.put_many(keys, list(range(500)))
    ix.put_many(["big", "bigger"], [0, 2**63])  # a list numpy would turn into float64
    assert ix.get("big") == 0 and ix.get("bigger") == 2**63
    addr, found = ix.lookup(keys + ["missing", hex_key()])
    assert found[:500].all() and not found[500:].any()
    np.testing.assert_array_equal(addr[:500], np.arange(500))
    np.testing.assert_array_equal(addr[500:], [0, 0])


def test_address_extremes_and_validation():
    ix = KeyIndex()
    ix.put("a", 2**64 - 1)
    ix.put("b", 0)
    assert ix.get("a") == 2**64 - 1 and ix.get("b") == 0
    for bad in (-1, 2**64, 2**70):
        with pytest.raises(ValueError, match=str(bad)):
            ix.put("c", bad)
    with pytest.raises(ValueError, match="-5"):
        ix.put_many(["c", "d"], np.array([1, -5]))
    with pytest.raises(ValueError, match=str(2**64)):
        ix.put_many(["c", "d"], [1, 2**64])
    with pytest.raises(ValueError):
        ix.put_many(["c", "d"], [1, 2, 3])
    with pytest.raises(TypeError):
        ix.put_many(["c", "d"], [1.5, 2.0])
    with pytest.raises(TypeError):
        ix.put_many(["c", "d"], np.array([1.0, 2.0]))
    with pytest.raises(TypeError):
        ix.put("c", 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ix.put_digests(np.zeros((2, 3), dtype=np.uint64), [1, 2])
    assert ix.get("c") is None and ix.get("d") is None and len(ix) == 2


def test_overwrite():
    ix = KeyIndex()
    k = hex_key()
    ix.put(k, 1)
    ix.put(k, 2)
    assert len(ix) == 1 and ix.get(k) == 2
    ix.put_many([k, "x", k], [3, 4, 5])  # last duplicate in a batch wins
    assert len(ix) == 2 and ix.get(k) == 5 and ix.get("x") == 4


def test_remove_then_miss():
    keys = [hex_key() for _ in range(100)]
    ix = KeyIndex()
    ix.put_many(keys, range(100))
    assert ix.remove_many(keys[:40] + ["never-stored"]) == 40
    assert ix.remove_many(keys[:40]) == 0
    assert len(ix) == 60
    addr, found = ix.lookup(keys)
    assert not found[:40].any() and found[40:].all()
    assert (addr[:40] == 0).all()
    assert ix.get(keys[0]) is None
    ix.put(keys[0], 99)
    assert ix.get(keys[0]) == 99 and len(ix) == 61


def _colliding_digests(capacity: int, home: int, count: int) -> np.ndarray:
    """Random digests whose home slot in a table of ``capacity`` is ``home``."""
    rng = np.random.default_rng(1)
    shift = np.uint64(64 - (capacity.bit_length() - 1))
    out = []
    while len(out) < count:
        d = rng.integers(2, 2**63, size=(4096, 2), dtype=np.uint64)
        h = ((d[:, 0] ^ (d[:, 1] * index_mod._K2)) * index_mod._K1) >> shift
        out.extend(d[h == home])
    return np.array(out[:count], dtype=np.uint64)


def test_tombstone_reuse_and_cleanup():
    ix = KeyIndex(16)
    a, b, c, d = _colliding_digests(16, 3, 4)
    ix.put_digests(np.array([a, b, c]), [1, 2, 3])  # slots 3, 4, 5
    assert ix.remove_digests(b[None]) == 1
    assert ix.tombstones == 1  # c still follows b, so b's slot stays a tombstone
    ix.put_digests(d[None], [4])
    assert ix.tombstones == 0 and len(ix) == 3 and ix.capacity == 16
    np.testing.assert_array_equal(ix._keys[4], d)  # d took b's slot
    addr, found = ix.lookup_digests(np.array([a, b, c, d]))
    np.testing.assert_array_equal(found, [True, False, True, True])
    np.testing.assert_array_equal(addr, [1, 0, 3, 4])
    # Removing the tail of a chain leaves no tombstone behind.
    ix.remove_digests(np.array([d, c]))
    assert ix.tombstones == 0 and len(ix) == 1


def test_churn_does_not_grow():
    ix = KeyIndex(1024)
    rng = np.random.default_rng(2)
    live = rng.integers(0, 2**64 - 1, size=(300, 2), dtype=np.uint64, endpoint=True)
    ix.put_digests(live, np.arange(300))
    for _ in range(300):
        new = rng.integers(0, 2**64 - 1, size=(300, 2), dtype=np.uint64, endpoint=True)
        ix.put_digests(new, np.arange(300) + 1000)
        assert ix.remove_digests(live) == 300
        live = new
        assert len(ix) == 300 and ix.capacity == 1024
        assert len(ix) + ix.tombstones <= 0.75 * ix.capacity
    addr, found = ix.lookup_digests(live)
    assert found.all() and (addr == np.arange(300) + 1000).all()


def test_growth_across_many_resizes():
    ix = KeyIndex(8)
    rng = np.random.default_rng(3)
    digests = rng.integers(0, 2**64 - 1, size=(200_000, 2), dtype=np.uint64, endpoint=True)
    addrs = rng.integers(0, 2**64 - 1, size=200_000, dtype=np.uint64, endpoint=True)
    caps = [ix.capacity]
    for i in range(1000):  # one at a time: observe every doubling 8 -> 2048
        ix.put_digests(digests[i:i + 1], addrs[i:i + 1])
        if ix.capacity != caps[-1]:
            caps.append(ix.capacity)
        assert len(ix) == i + 1 <= 0.75 * ix.capacity
    assert caps == [2**k for k in range(3, 12)]
    start = 1000
    for size in [1, 2, 5, 100, 7, 4000, 33, 60_000, 134_852]:
        ix.put_digests(digests[start:start + size], addrs[start:start + size])
        start += size
        assert len(ix) == start <= 0.75 * ix.capacity
    assert start == 200_000 and ix.capacity == 2**19 and ix.tombstones == 0
    got, found = ix.lookup_digests(digests)
    assert found.all()
    np.testing.assert_array_equal(got, addrs)
    keys = [hex_key() for _ in range(1000)]
    for i, k in enumerate(keys):
        ix.put(k, i)
    assert all(ix.get(k) == i for i, k in enumerate(keys))
    assert ix.nbytes == ix._keys.nbytes + ix._vals.nbytes + ix._counts.nbytes
    assert ix.nbytes >= 24 * ix.capacity


def test_prefix_hits():
    keys = [hex_key() for _ in range(10)]
    ix = KeyIndex()
    ix.put_many(keys[:5] + [keys[6]], range(6))
    assert ix.prefix_hits(keys) == 5
    assert ix.prefix_hits(keys[:5]) == 5
    assert ix.prefix_hits(keys[5:]) == 0
    assert ix.prefix_hits([]) == 0
    assert ix.prefix_hits([keys[0], "abc"]) == 1
    ix.put("abc", 1)
    assert ix.prefix_hits([keys[0], "abc", keys[1]]) == 3


def test_reserved_digests_are_remapped():
    ix = KeyIndex(8)
    special = np.array([[0, 0], [0, 1]], dtype=np.uint64)
    ix.put_digests(special, [5, 6])
    assert len(ix) == 2
    addr, found = ix.lookup_digests(special)
    assert found.all() and list(addr) == [5, 6]
    _, found = ix.lookup_digests(np.array([[0, 4], [1, 0]], dtype=np.uint64))
    assert not found.any()
    dk, dv = ix.items_digests()
    assert sorted(map(tuple, dk.tolist())) == [(0, 2), (0, 3)]
    assert ix.remove_digests(special) == 2 and len(ix) == 0


def test_items_digests_and_clear():
    keys = [hex_key() for _ in range(50)] + ["q", "r"]
    ix = KeyIndex(8)
    ix.put_many(keys, range(52))
    ix.remove_many(keys[:10])
    dk, dv = ix.items_digests()
    got = {tuple(d): int(v) for d, v in zip(dk.tolist(), dv.tolist())}
    assert got == {tuple(row(k).tolist()): i for i, k in enumerate(keys) if i >= 10}
    ix.clear()
    assert len(ix) == 0 and ix.capacity == 8 and ix.tombstones == 0
    assert ix.get(keys[20]) is None
    assert ix.items_digests()[0].shape == (0, 2)


# ------------------------------------------------------------------ model-based

POOL = [hex_key() for _ in range(40)] + [f"k{i}" for i in range(20)] + ["", "x" * 64]
key_st = st.sampled_from(POOL)
addr_st = st.integers(0, 2**64 - 1)
op_st = st.one_of(
    st.tuples(st.just("put"), key_st, addr_st),
    st.tuples(st.just("put_many"), st.lists(st.tuples(key_st, addr_st), max_size=20)),
    st.tuples(st.just("remove"), st.lists(key_st, max_size=20)),
    st.tuples(st.just("lookup"), st.lists(key_st, max_size=20)),
    st.tuples(st.just("prefix"), st.lists(key_st, max_size=8)),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op_st, max_size=60))
def test_matches_dict_model(ops):
    ix = KeyIndex(8)
    model: dict[str, int] = {}
    for op in ops:
        if op[0] == "put":
            ix.put(op[1], op[2])
            model[op[1]] = op[2]
        elif op[0] == "put_many":
            ix.put_many([k for k, _ in op[1]], [a for _, a in op[1]])
            model.update(op[1])
        elif op[0] == "remove":
            present = {k for k in op[1] if k in model}
            assert ix.remove_many(op[1]) == len(present)
            for k in present:
                del model[k]
        elif op[0] == "lookup":
            addr, found = ix.lookup(op[1])
            assert found.tolist() == [k in model for k in op[1]]
            assert addr.tolist() == [model.get(k, 0) for k in op[1]]
        else:
            expect = next((i for i, k in enumerate(op[1]) if k not in model), len(op[1]))
            assert ix.prefix_hits(op[1]) == expect
        assert len(ix) == len(model)
        assert len(ix) + ix.tombstones <= 0.75 * ix.capacity
    for k in POOL:
        assert ix.get(k) == model.get(k)
    dk, dv = ix.items_digests()
    got = {tuple(d): v for d, v in zip(dk.tolist(), dv.tolist())}
    assert got == {tuple(row(k).tolist()): v for k, v in model.items()}


# ------------------------------------------------------------------ memory


@pytest.mark.slow
def test_memory_per_key_at_ten_million():
    n = 10_000_000
    rng = np.random.default_rng(4)
    digests = rng.integers(0, 2**64 - 1, size=(n, 2), dtype=np.uint64, endpoint=True)
    addrs = np.arange(n, dtype=np.uint64) * 4096
    ix = KeyIndex()
    ix.put_digests(digests, addrs)
    assert len(ix) == n
    assert ix.nbytes / len(ix) <= 64, ix.nbytes / len(ix)
    sample = rng.choice(n, size=10_000, replace=False)
    got, found = ix.lookup_digests(digests[sample])
    assert found.all()
    np.testing.assert_array_equal(got, addrs[sample])
