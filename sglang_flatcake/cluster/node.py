"""This server's place in a cluster (``--flatcake-cluster-directory``): its lease in the
directory, the owner service over its store, the publisher, and a reader for the runs other
nodes hold.

Sizes follow the page: one owner staging slot, one transfer, is ``CHUNK_BYTES`` of whole
blocks (every node computes the same from the same layout, so a requester's chunk always
fits the owner's slot).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import numpy as np

from ..errors import ConfigError
from .directory import DirectoryError
from .owner import OwnerService
from .publisher import Publisher
from .redis_directory import RedisDirectory, redis_url_for_logs
from .requester import RemoteReader
from .roster_watch import RosterWatch
from .secret import ClusterSecret
from .span import RemoteSpan, fetch_span, remote_span
from .transfer import Engine

log = logging.getLogger("sglang_flatcake")
CHUNK_BYTES = 16 << 20      # per slot and transfer (benchmarks/remote_restore.py's best chunk)
SLOTS = 4                   # owner staging slots (concurrent grants)
RECEIVE_CHUNKS = 4          # requester receive buffer, in chunks: one fetch call's reach
DIRECTORY_BACKOFF_S = 5.0   # after a failed lookup, requests skip the directory this long


class ClusterNode:
    """Joins the directory as ``config.node_id`` (refused when a live node holds that id),
    serves ``store`` to the other nodes and restores their runs.  ``close`` leaves (the
    node's entries go) and stops every thread; the store stays the caller's."""

    def __init__(self, store, config) -> None:
        self.node, self.timeout_s = config.node_id, config.remote_timeout_s
        lay = store.layout
        self.chunk_blocks = max(1, CHUNK_BYTES // lay.block_bytes)
        self.counters = {"remote_lookups": 0, "remote_blocks": 0, "remote_misses": 0,
                         "directory_down": 0, "lookup_failures": 0}
        self._down_until = 0.0
        if not config.cluster_secret_file:
            raise ConfigError("cluster_secret_file='' is not allowed: a cluster node needs the "
                              "cluster's secret file (--flatcake-cluster-secret-file; "
                              "docs/cluster-security.md)")
        if not config.cluster_node_key_file or not config.cluster_roster_file:
            raise ConfigError("cluster_node_key_file and cluster_roster_file are required in a "
                              "cluster: each node's own key and the operator's roster "
                              "(--flatcake-cluster-node-key-file, --flatcake-cluster-roster-file;"
                              " docs/cluster.md)")
        secret = ClusterSecret.for_node(config.cluster_secret_file, config.node_id,
                                        config.cluster_node_key_file, config.cluster_roster_file)
        made: list = []
        try:
            self.roster = RosterWatch(secret.identity, config.cluster_roster_file)
            made.append(self.roster)
            self.engine = Engine(config.cluster_bind)
            made.append(self.engine)
            self.directory = RedisDirectory(config.cluster_directory, secret,
                                            timeout_s=min(0.5, self.timeout_s))
            made.append(self.directory)
            self.service = OwnerService(store, self.engine, secret, self.directory,
                                        host=config.cluster_bind, slots=SLOTS,
                                        slot_blocks=self.chunk_blocks,
                                        lease_s=max(2.0, 2 * self.timeout_s))
            made.append(self.service)
            self.reader = RemoteReader(self.engine, lay, secret, self.chunk_blocks * RECEIVE_CHUNKS,
                                       self.timeout_s, self.chunk_blocks)
            self.directory.join(self.node, self.service.endpoint, exclusive=True)
        except BaseException:
            for part in reversed(made):
                part.close()
            raise
        self.publisher = Publisher(self.service)
        store.reclaimer.listeners.append(self.publisher.reclaimed)
        self._store = store
        log.info("flatcake: node %d joined the cluster at %s (serving on %s, transfers %s)",
                 self.node, redis_url_for_logs(config.cluster_directory), self.service.endpoint,
                 self.engine.session)

    def lookup(self, tenant: str, keys: Sequence[str]) -> RemoteSpan | None:
        """One directory round trip: the leading run of ``keys`` other live nodes hold
        (None: none, or the directory is unreachable -- then skipped for a while).  Never
        raises: any other failure is a miss, logged once."""
        if not keys or time.monotonic() < self._down_until:
            return None
        self.counters["remote_lookups"] += 1
        try:
            found = self.directory.lookup(tenant, list(keys))
        except DirectoryError as e:
            self.counters["directory_down"] += 1
            self._down_until = time.monotonic() + DIRECTORY_BACKOFF_S
            log.warning("flatcake: %s; remote restores off for %.0fs", e, DIRECTORY_BACKOFF_S)
            return None
        except Exception:                  # a bug must not cost the request its local hits
            self.counters["lookup_failures"] += 1
            if self.counters["lookup_failures"] == 1:
                log.exception("flatcake: a directory lookup failed (a miss; logged once)")
            return None
        return remote_span(found, tenant, keys, self.node)

    def fetch(self, span: RemoteSpan, sink: Callable[[int, np.ndarray], None]) -> int:
        """``span.fetch_span`` through this node's reader, within one ``remote_timeout_s``."""
        return fetch_span(self.reader, span, sink, self.timeout_s, self.counters)

    def stats(self) -> dict:
        d = self.directory
        return {**self.counters, **self.publisher.counters, "node": self.node,
                "forged_entries": d.forged, "purged_entries": d.purged, "lease_lost": d.lost,
                "owner": dict(self.service.counters), "set_aside": self.reader.set_aside,
                "registered_bytes": self.engine.registered_bytes,
                "transfer_retries": self.engine.retried,
                "engine_exposed_ports": len(self.engine.exposed), **self.roster.counts}

    def close(self) -> None:
        """Publish what is queued, leave the directory, stop serving; idempotent."""
        if self._store is None:
            return
        if self.publisher.reclaimed in self._store.reclaimer.listeners:
            self._store.reclaimer.listeners.remove(self.publisher.reclaimed)
        self._store = None
        self.publisher.close()
        try:
            self.directory.close()
        except DirectoryError as e:        # unreachable: the lease lapses on its own
            log.warning("flatcake: could not leave the cluster (%s); its lease lapses in %d ms",
                        e, self.directory.lease_ms)
        self.service.close()
        self.reader.close()
        self.engine.close()
        self.roster.close()
