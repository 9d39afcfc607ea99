"""The cluster directory's contract: which node holds a stored page, one round trip per
lookup (``redis_directory.RedisDirectory`` is the implementation).

Granularity is the page (one store key).  Tenants (``cache_salt``) live under their own
prefix, keyed with the cluster secret (``ClusterSecret.tag``), so one tenant's lookup can
never name another's page and a tag does not reveal its salt.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence

from ..errors import FlatCakeError


class DirectoryError(FlatCakeError):
    """The directory service could not be reached or refused a call; nothing was changed
    by a failed ``publish``/``remove_session`` beyond what the service had applied."""


@dataclass(frozen=True)
class Owner:
    node: int
    endpoint: str                # the owner's request-service address (``tcp://host:port``)


@dataclass(frozen=True)
class Lookup:
    """The leading run of a request's keys that live nodes hold.

    ``owners[i]`` is the node holding key ``i`` for ``i < hits``; ``endpoints`` maps each
    of those nodes to its service address.  ``hits == 0`` is a miss."""

    hits: int
    owners: tuple[int, ...]
    endpoints: dict[int, str]

    def runs(self) -> list[tuple[int, int, int]]:
        """``(node, start, count)`` for each stretch of the hit run held by one node."""
        out: list[tuple[int, int, int]] = []
        for i, n in enumerate(self.owners):
            if out and out[-1][0] == n:
                out[-1] = (n, out[-1][1], out[-1][2] + 1)
            else:
                out.append((n, i, 1))
        return out


class Directory(abc.ABC):
    """Contract every directory implementation meets (tests/cluster/test_cluster_directory.py)."""

    @abc.abstractmethod
    def join(self, node: int, endpoint: str) -> None:
        """Take this node's lease (refreshed until ``leave``/``close``).  Raises
        ``ConfigError`` for a node outside 0..4095 or an endpoint with ``|`` in it."""

    @abc.abstractmethod
    def leave(self) -> None:
        """Drop the lease and every entry this node published; a no-op when not joined."""

    @abc.abstractmethod
    def publish(self, tenant: str, session: str, keys: Sequence[str]) -> None:
        """Record that this node holds ``keys`` of ``session`` for ``tenant``.  Raises
        ``DirectoryError`` when not joined."""

    @abc.abstractmethod
    def remove_session(self, tenant: str, session: str) -> int:
        """Drop ``session``'s entries that still name this node (a page another node has
        since published stays theirs); returns how many went.  Unknown session: 0."""

    @abc.abstractmethod
    def lookup(self, tenant: str, keys: Sequence[str]) -> Lookup:
        """The leading run of ``keys`` held by live nodes, in one round trip."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the heartbeat and leave; a second call does nothing."""

