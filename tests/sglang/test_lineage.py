"""What a write continues (``sglang/lineage.py``, both modes): turn, previous reply and position
come from the store's lineage of the parent key; no parent or an unknown one starts a chain."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_flatcake.session_table import Lineage
from sglang_flatcake.sglang.lineage import Continues, continues


class Store:
    """The two things ``continues`` reads of a store: ``lineage`` and the page size."""

    def __init__(self, lineages: dict) -> None:
        self.lineages, self.asked = lineages, []
        self.layout = SimpleNamespace(page_tokens=16)

    def lineage(self, key):
        self.asked.append(key)
        return self.lineages.get(key)


def test_a_write_after_a_stored_key_continues_its_lineage():
    lin = Lineage(session=1, writes=5, last_write_blocks=3, last_reply_blocks=2, position=7,
                  at_tail=True)
    store = Store({"p": lin})
    assert continues(store, "p") == Continues(turn=2, prev_reply_tokens=32, position_tokens=112)


def test_no_parent_or_an_unknown_one_starts_a_chain_at_turn_0():
    store = Store({})
    assert continues(store, None) == Continues(0, 0, 0) and store.asked == []
    assert continues(store, "gone") == Continues(0, 0, 0) and store.asked == ["gone"]
