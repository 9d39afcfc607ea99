"""flatcake's counters as Prometheus gauges (``flatcake_*``), next to SGLang's own.

Only active when ``prometheus_client`` is importable; SGLang polls the backend's
``get_stats`` (and so this) when ``--enable-metrics`` / storage metrics are on.
In SGLang's multi-process mode each gauge keeps its most recent value.
"""

from __future__ import annotations

import re

_gauges: dict = {}


def flatten(stats: dict, prefix: str = "") -> dict[str, float]:
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


def export(stats: dict) -> None:
    try:
        from prometheus_client import Gauge
    except ImportError:
        return
    for name, value in flatten(stats).items():
        g = _gauges.get(name)
        if g is None:
            try:
                g = Gauge(f"flatcake_{name}", f"flatcake store: {name}",
                          multiprocess_mode="mostrecent")
            except ValueError:   # older prometheus_client, or already registered
                try:
                    g = Gauge(f"flatcake_{name}", f"flatcake store: {name}")
                except ValueError:
                    continue
            _gauges[name] = g
        g.set(value)
