"""No silent fallbacks in the SGLang adapter: each former one is an error or a counted, reported
state (cpu.py's CUDA probe, backend.py's metrics type, metrics.py's gauges)."""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
hs = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from tests.support import chain  # noqa: E402
from sglang_flatcake.sglang import cpu  # noqa: E402
from sglang_flatcake.sglang.hicache.backend import FlatCakeStorage  # noqa: E402
from sglang_flatcake.sglang.metrics import MetricsExporter  # noqa: E402

L, H, D, PS, PAGES = 2, 2, 8, 4, 16


def host_pool():
    k = torch.zeros((PAGES, L, PS, H, D), dtype=torch.bfloat16)
    return SimpleNamespace(k_buffer=k, v_buffer=k.clone(), layout="page_first_direct",
                           page_size=PS, layer_num=L)


def storage_config(tmp_path, metrics=False):
    return hs.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=metrics, is_page_first_layout=True,
        model_name="tiny", extra_config={"store_dir": str(tmp_path), "memory_bytes": "1MiB"})


# -- cpu.py: a failed CUDA probe is an error, not "no GPU" ---------------------------------

def test_a_failing_cuda_probe_raises_instead_of_installing_the_cpu_hooks(monkeypatch):
    def broken():
        raise RuntimeError("CUDA driver initialization failed")
    monkeypatch.setattr(torch.cuda, "is_available", broken)
    with pytest.raises(cpu.AcceleratorProbeError, match="CUDA driver initialization failed"):
        cpu.accelerator_present()


def test_a_cpu_hicache_launch_stops_with_one_line_when_the_probe_fails(monkeypatch, capsys):
    """The probe decides the ``cpu`` mode in the launcher (``plugin.modes_of``; it ran in
    ``register`` before the hooks were started per mode): a failed probe stops the launch
    with one line, nothing registered, SGLang's parsing not run."""
    pytest.importorskip("sglang.srt.plugins.hook_registry")
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_flatcake.sglang import plugin
    registered, parsed = [], []
    monkeypatch.setattr(HookRegistry, "register", classmethod(
        lambda cls, *a, **kw: registered.append(a)))
    monkeypatch.setattr(torch.cuda, "is_available",
                        lambda: (_ for _ in ()).throw(RuntimeError("no driver answer")))
    args = SimpleNamespace(hicache_storage_backend="file", enable_hierarchical_cache=True,
                           hicache_storage_backend_extra_config=None,
                           enable_unified_cache_external_linker=False)
    with pytest.raises(SystemExit) as e:
        plugin._from_cli_args_around(lambda *a: parsed.append(a), object, args)
    assert e.value.code == 2 and registered == [] and parsed == []  # nothing half-registered
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no driver answer" in err[0]


def test_the_cpu_io_resolution_does_not_swallow_sglang_errors(monkeypatch):
    pytest.importorskip("sglang.srt.arg_groups.hicache_hook")
    import sglang.srt.arg_groups.hicache_hook as hh

    def moved(server_args):
        raise AttributeError("'ServerArgs' object has no attribute 'hicache_io_backend'")
    monkeypatch.setattr(hh, "resolving_view", moved)
    with pytest.raises(AttributeError, match="hicache_io_backend"):
        cpu._resolve_io_around(lambda args: None, SimpleNamespace())


# -- backend.py: no look-alike metrics class ---------------------------------------------------

def test_no_storage_metrics_type_fails_at_construction(tmp_path, monkeypatch):
    """Without SGLang's ``StorageMetrics`` the backend is not built (the old code substituted
    a look-alike class, which SGLang's collector then rejects at the first poll)."""
    monkeypatch.setitem(sys.modules, "sglang.srt.observability.metrics_collector", None)
    with pytest.raises(ImportError):
        FlatCakeStorage(storage_config(tmp_path), host_pool())


def test_get_stats_returns_sglangs_storage_metrics(tmp_path):
    from sglang.srt.observability.metrics_collector import StorageMetrics
    be = FlatCakeStorage(storage_config(tmp_path), host_pool())
    got = be.get_stats()
    assert isinstance(got, StorageMetrics)
    assert got.flatcake["metrics"] == {"enabled": False, "gauges": 0, "export_errors": 0,
                                       "last_error": ""}
    be.close()


# -- metrics.py: per-backend gauges; a failure is logged, counted, reported ---------------------

def test_two_backends_keep_their_own_gauges(tmp_path):
    pytest.importorskip("prometheus_client")
    a = FlatCakeStorage(storage_config(tmp_path / "a", metrics=True), host_pool())
    b = FlatCakeStorage(storage_config(tmp_path / "b", metrics=True), host_pool())
    keys = chain(3, "m")
    a.batch_set_v1(keys, torch.arange(3 * PS), hs.HiCacheStorageExtraInfo(prefix_keys=[]))
    sa, sb = a.get_stats().flatcake, b.get_stats().flatcake
    assert a.metrics.state()["gauges"] > 0 and a.metrics.state()["export_errors"] == 0
    blocks = lambda be: be.metrics._registry.get_sample_value(          # noqa: E731
        "flatcake_sessions", {"store": str(be.dir)})
    assert blocks(a) == sa["sessions"] == 1 and blocks(b) == sb["sessions"] == 0
    a.close()
    b.close()


def test_a_gauge_that_cannot_be_made_is_counted_and_reported(monkeypatch, caplog):
    pytest.importorskip("prometheus_client")
    ex = MetricsExporter(True, "s")

    def refuse(name, *a, **kw):
        raise ValueError(f"Duplicated timeseries in CollectorRegistry: {{'{name}'}}")
    monkeypatch.setattr(ex._prom, "Gauge", refuse)
    with caplog.at_level(logging.WARNING, logger="sglang_flatcake"):
        ex.export({"x": 1, "y": {"z": 2}})
        ex.export({"x": 3})
    st = ex.state()
    assert st["export_errors"] == 3 and "flatcake_x" in st["last_error"]
    assert caplog.text.count("not exported") == 1                  # warned once, then counted


def test_metrics_off_exports_nothing():
    ex = MetricsExporter(False, "s")
    ex.export({"x": 1})
    assert ex.state() == {"enabled": False, "gauges": 0, "export_errors": 0, "last_error": ""}
