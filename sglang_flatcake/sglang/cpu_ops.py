"""Torch-native KV transfer ops with the signatures of ``sgl_kernel.kvcacheio``, for a CPU
server where SGLang binds none (``cpu.bind_cpu_transfer_ops`` binds them).  Each copies
with tensor indexing; a count of buffers that does not match raises ``ValueError``.
"""

from __future__ import annotations

from typing import Sequence


def transfer_kv_direct(src_layers: Sequence, dst_layers: Sequence, src_indices, dst_indices,
                       page_size: int) -> None:
    """Token-indexed copy per layer buffer: ``dst[dst_indices] = src[src_indices]``."""
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"transfer_kv_direct: {len(src_layers)} sources for {len(dst_layers)} "
                         "destinations")
    si, di = src_indices.long(), dst_indices.long()
    for s, d in zip(src_layers, dst_layers):
        d[di] = s[si].to(d.device)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs: Sequence, dst_ptrs: Sequence, src_indices,
                                       dst_indices, layer_id: int, page_size: int) -> None:
    """Host ``page_first_direct`` ``[page, layer, page_size, ...]`` -> device layer buffers."""
    si, di = src_indices.long(), dst_indices.long()
    page, off = si // page_size, si % page_size
    for s, d in zip(src_ptrs, dst_ptrs):
        d[di] = s[page, layer_id, off].to(d.device)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs: Sequence, dst_ptrs: Sequence, src_indices,
                                       dst_indices, page_size: int) -> None:
    """Device layer buffers (all K layers, then all V layers) -> host ``page_first_direct``."""
    parts = len(dst_ptrs)
    if parts == 0 or len(src_ptrs) % parts:
        raise ValueError(f"transfer_kv_all_layer_direct_lf_pf: {len(src_ptrs)} layer buffers "
                         f"for {parts} host buffers")
    layers = len(src_ptrs) // parts
    si, di = src_indices.long(), dst_indices.long()
    page, off = di // page_size, di % page_size
    for p, d in enumerate(dst_ptrs):
        for layer in range(layers):
            d[page, layer, off] = src_ptrs[p * layers + layer][si].to(d.device)
