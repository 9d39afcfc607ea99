"""Rank agreement (``sglang/ranks.py``): alone, values pass unchanged; an unknown op is refused.
Two real gloo ranks agreeing are tested where both modes use it
(``hicache/test_scheduling.py::test_tp_ranks_reach_the_same_decisions``, ``linker/test_mla.py``)."""

from __future__ import annotations

import pytest

from sglang_flatcake.sglang.ranks import RankAgreement


def test_one_rank_agrees_with_itself():
    agree = RankAgreement(None)
    assert agree.group is None
    assert agree([3, 1.5], "min") == [3, 1.5] and agree([2]) == [2] and agree([], "max") == []


def test_an_unknown_op_is_refused_by_name():
    with pytest.raises(ValueError, match="op='sum' is not allowed"):
        RankAgreement(None)([1], "sum")
