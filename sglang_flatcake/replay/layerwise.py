"""Layer-wise restore under prefill: the pipeline arithmetic of the linker mode.

SGLang's direct external linker starts a request's restore with its forward and the
forward waits per layer, so layer ``l``'s prefill starts once layer ``l``'s KV has
landed *and* layer ``l - 1``'s prefill is done.  With ``L`` layers, a restore that
starts at ``load_start`` and reads layer after layer at an even pace over ``load_s``
seconds lands layer ``l`` (1-based) at ``load_start + l * load_s / L``; each layer's
prefill takes ``compute_s / L``::

    t_0 = start
    t_l = max(t_{l-1}, load_start + l * load_s / L) + compute_s / L
    end = t_L

so ``end - start ~ max(load_s, compute_s) + min(load_s, compute_s) / L`` when the load
starts with the forward (restore-bound: the last layer's prefill after the last layer
lands; compute-bound: the first layer's load before the first prefill).  Restoring
the whole span first and prefilling after (HiCache mode) takes ``load_s + compute_s``.
"""

from __future__ import annotations


def pipeline_end(start: float, load_start: float, load_s: float, compute_s: float,
                 layers: int) -> float:
    """When the last layer's prefill ends (see the module docstring); ``ValueError`` for a
    negative duration, fewer than one layer, or a load that starts before the forward."""
    if layers < 1:
        raise ValueError(f"layers={layers!r} is not allowed: expected >= 1")
    if load_s < 0 or compute_s < 0:
        raise ValueError(f"load_s={load_s!r}, compute_s={compute_s!r}: expected >= 0")
    if load_start < start:
        raise ValueError(f"load_start={load_start!r} is before start={start!r}")
    c = compute_s / layers
    t = start
    for layer in range(1, layers + 1):
        t = max(t, load_start + layer * load_s / layers) + c
    return t


def serial_end(start: float, load_s: float, compute_s: float) -> float:
    """Whole restore, then prefill (HiCache mode's order, no overlap)."""
    if load_s < 0 or compute_s < 0:
        raise ValueError(f"load_s={load_s!r}, compute_s={compute_s!r}: expected >= 0")
    return start + load_s + compute_s
