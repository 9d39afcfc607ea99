import pytest

from sglang_flatcake.address import MAX_NODE, MAX_OFFSET, Medium, decode, encode


@pytest.mark.parametrize("medium", list(Medium))
@pytest.mark.parametrize("node", [0, 1, MAX_NODE])
@pytest.mark.parametrize("offset", [0, 1, 4096, MAX_OFFSET])
def test_round_trip_at_the_limits(medium, node, offset):
    a = encode(medium, node, offset)
    assert 0 <= a < 1 << 64
    assert decode(a) == (medium, node, offset)


def test_bit_positions():
    assert encode(Medium.SSD, 0, 0) == 1 << 60
    assert encode(Medium.MEMORY, 1, 0) == 1 << 48
    assert encode(Medium.MEMORY, 0, 5) == 5


@pytest.mark.parametrize("args,name", [
    ((Medium.SSD, MAX_NODE + 1, 0), "node"),
    ((Medium.SSD, -1, 0), "node"),
    ((Medium.SSD, 0, MAX_OFFSET + 1), "offset"),
    ((Medium.SSD, 0, -1), "offset"),
    ((16, 0, 0), "medium"),
])
def test_out_of_range_refused(args, name):
    with pytest.raises(ValueError, match=name):
        encode(*args)


def test_decode_refuses_garbage():
    with pytest.raises(ValueError):
        decode(1 << 64)
    with pytest.raises(ValueError, match="unknown medium"):
        decode(7 << 60)
