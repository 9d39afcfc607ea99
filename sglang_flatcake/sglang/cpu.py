"""What makes SGLang 0.5.23's HiCache run on a CPU server, as runtime hooks.

The hooks (``cpu_only`` in ``hooks.HOOKS``) are registered only when neither CUDA
nor XPU is present, so nothing changes on a GPU; when torch cannot say,
``accelerator_present`` raises and the launch stops (no guess either way):

1. ``HostKVCache.__init__``: no memory pinning without an accelerator (pinning
   calls ``cudaHostRegister``).
2. ``pool_host.mha`` / ``pool_host.mla``: the transfer ops SGLang binds only on
   CUDA/HIP/XPU are bound to the torch-native equivalents of ``cpu_ops``.
3. ``resolve_layout_io_compatibility``: on ``--device cpu`` the default
   ``kernel`` I/O backend resolves to ``direct`` (and so the default
   ``page_first`` layout to ``page_first_direct``).
"""

from __future__ import annotations

import logging

from .cpu_ops import (transfer_kv_all_layer_direct_lf_pf, transfer_kv_direct,
                      transfer_kv_per_layer_direct_pf_lf)

log = logging.getLogger("sglang_flatcake")

_OPS = ("transfer_kv_direct", "transfer_kv_per_layer_direct_pf_lf",
        "transfer_kv_all_layer_direct_lf_pf")   # bound from this module's names (``cpu_ops``)


class AcceleratorProbeError(RuntimeError):
    """torch could not say whether CUDA or XPU is present: the CPU hooks are not installed on
    a guess (they would turn off page pinning and the kernel I/O backend on a GPU)."""


def accelerator_present() -> bool:
    """Is CUDA (or XPU) usable?  ``AcceleratorProbeError`` when probing fails, never a guess."""
    import torch
    try:
        if torch.cuda.is_available():
            return True
        return bool(hasattr(torch, "xpu") and torch.xpu.is_available())
    except (RuntimeError, AssertionError, OSError) as e:
        raise AcceleratorProbeError(f"cannot tell whether an accelerator is present "
                                    f"({type(e).__name__}: {e}); the CPU hooks stay off") from e


# -- hooks -----------------------------------------------------------------------------

def _no_pin_before_init(*args, **kwargs):
    """Runs as each host pool is built (scheduler process): no pinning, CPU ops bound."""
    if accelerator_present():
        return None
    bind_cpu_transfer_ops()
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
        return args, kwargs
    return None


def _resolve_io_around(original, server_args, *a, **kw):
    """After SGLang's resolution, ``--device cpu`` with the ``kernel`` I/O backend becomes
    ``direct`` (and ``page_first`` becomes ``page_first_direct``).  The two SGLang functions
    used are checked at start (``hooks.MEMBERS``); an error here stops the launch."""
    from sglang.srt.arg_groups.hicache_hook import declare_resolution, resolving_view
    result = original(server_args, *a, **kw)
    cfg = resolving_view(server_args)
    if cfg.device == "cpu" and cfg.hicache_io_backend == "kernel" and not accelerator_present():
        declare_resolution(server_args, "_resolve_layout_io_compatibility",
                           hicache_io_backend="direct")
        if cfg.hicache_mem_layout == "page_first":
            declare_resolution(server_args, "_resolve_layout_io_compatibility",
                               hicache_mem_layout="page_first_direct")
        log.info("flatcake: --device cpu: HiCache I/O backend resolved to direct")
    return result


def bind_cpu_transfer_ops() -> None:
    """Bind the torch-native ops into the loaded host-pool modules that SGLang left unbound.

    The ops are module globals looked up at call time, so binding them before the
    first transfer is enough; modules not imported yet are bound when their pool is built.
    """
    if accelerator_present():
        return
    import sys
    this = sys.modules[__name__]
    for modname in ("sglang.srt.mem_cache.pool_host.mha", "sglang.srt.mem_cache.pool_host.mla"):
        mod = sys.modules.get(modname)
        if mod is None:
            continue
        for op in _OPS:
            if not hasattr(mod, op):
                setattr(mod, op, getattr(this, op))
