"""Opening the nodes of a ``--nodes`` replay: one ``ClusterNode`` (a real store) per node
under one shared ``ClusterState`` (directory, counters, remote model).  Re-exported by
``cluster``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from .cluster_directory import Directory
from .cluster_node import ClusterCounters, ClusterNode, ClusterState
from .remote import RemoteModel
from .systems.base import SystemContext


def open_nodes(n: int, enabled: bool, remote: RemoteModel, make_ctx: Callable[[int, Path],
               SystemContext], root: Path) -> tuple[list[ClusterNode], ClusterState]:
    """``n`` opened nodes, node k's store under ``root/node{k}``; close each after."""
    state = ClusterState(enabled, remote, Directory(), ClusterCounters(), [])
    for k in range(n):
        node = ClusterNode(k, state)
        d = root / f"node{k}"
        d.mkdir(parents=True)
        try:
            node.open(make_ctx(k, d))
        except BaseException:
            for m in state.nodes:
                m.close()
            raise
        state.nodes.append(node)
    return state.nodes, state

