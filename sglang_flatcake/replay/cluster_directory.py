"""The replay's page directory: page key -> the node that last wrote it."""

from __future__ import annotations


class Directory:
    """Page key -> the node that last wrote it.  An entry whose node has since reclaimed
    the page reads as that node's shorter run at lookup (the real directory drops it)."""

    def __init__(self) -> None:
        self._owner: dict[str, int] = {}

    def publish(self, node: int, keys: list[str]) -> None:
        for k in keys:
            self._owner[k] = node

    def owner(self, key: str) -> int | None:
        return self._owner.get(key)
