"""flatcake's counters as Prometheus gauges (``flatcake_*``), next to SGLang's own.

Each backend owns one ``MetricsExporter`` (``FlatCakeStorage.metrics``).  SGLang polls the
backend's ``get_stats`` (and so ``export``) when storage metrics are on
(``--enable-metrics``).  SGLang serves ``/metrics`` in prometheus_client's multi-process
mode, which reads every gauge written in any process, whatever registry it was created in; so
each exporter creates its gauges in a registry of its own (two backends in one process do not
collide) and labels them with its store directory (``store``), each keeping its most recent
value.  A gauge that cannot be created or set is not skipped silently: the error is logged
once, counted and reported under ``metrics`` in ``get_stats``.
"""

from __future__ import annotations

import logging
import re
import threading

log = logging.getLogger("sglang_flatcake")


def flatten(stats: dict, prefix: str = "") -> dict[str, float]:
    """Numbers (and booleans) of a nested stats dict, keyed by ``a_b_c`` metric names."""
    out = {}
    for k, v in stats.items():
        name = re.sub(r"[^a-zA-Z0-9_]", "_", f"{prefix}{k}")
        if isinstance(v, dict):
            out.update(flatten(v, name + "_"))
        elif isinstance(v, bool):
            out[name] = float(v)
        elif isinstance(v, (int, float)):
            out[name] = float(v)
    return out


class MetricsExporter:
    """One backend's ``flatcake_*`` gauges.  ``enabled`` False (storage metrics off): nothing is
    exported and ``state`` says so.  Enabled without ``prometheus_client``: ``ImportError`` at
    construction (SGLang's own metrics need it too)."""

    def __init__(self, enabled: bool, store: str) -> None:
        self.enabled, self.store = enabled, store
        self._lock = threading.Lock()
        self._gauges: dict = {}
        self.errors = 0                 # gauges that could not be created or set
        self.last_error = ""
        if enabled:
            import prometheus_client
            self._prom = prometheus_client
            self._registry = prometheus_client.CollectorRegistry()

    def export(self, stats: dict) -> None:
        """Set one gauge per number in ``stats``; a failure is logged (first time), counted."""
        if not self.enabled:
            return
        with self._lock:
            for name, value in flatten(stats).items():
                try:
                    g = self._gauges.get(name)
                    if g is None:
                        g = self._prom.Gauge(f"flatcake_{name}", f"flatcake store: {name}",
                                             ["store"], registry=self._registry,
                                             multiprocess_mode="mostrecent")
                        self._gauges[name] = g
                    g.labels(store=self.store).set(value)
                except ValueError as e:
                    self.errors += 1
                    self.last_error = f"flatcake_{name}: {e}"
                    if self.errors == 1:
                        log.warning("flatcake: metric %s not exported: %s (counted under "
                                    "metrics.export_errors in get_stats)", name, e)

    def state(self) -> dict:
        """What the exporter did: enabled, gauges it keeps, errors (and the last one)."""
        with self._lock:
            return {"enabled": self.enabled, "gauges": len(self._gauges),
                    "export_errors": self.errors, "last_error": self.last_error}
