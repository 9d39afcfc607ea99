"""SGLang's linker contract, run from SGLang's own source files where SGLang cannot import.

The GPU machine has torch and CuPy but not SGLang's dependencies (sgl-kernel, zmq and the
rest), so ``import sglang`` fails there.  ``load_linker_contract(src)`` reads two files of
an SGLang 0.5.23 source tree (``benchmarks/README_gpu.md`` copies them beside the run):
``srt/mem_cache/hicache_storage.py`` and ``srt/mem_cache/unified_cache/unified_cache_linker.py``,
and executes only the classes ``sglang/linker/linker.py`` imports (``PoolHitPolicy``, ``PoolName``,
``PoolTransfer``; ``LayerWiseLoadCounter``, ``UnifiedCacheLinker``) with their standard-library
and torch imports, as the modules of those names.  The counter, the offload events and the
transfer descriptor are then SGLang's code, not a copy: only ``get_device_module`` is
written here (``torch.cuda`` on a CUDA machine, as SGLang's own returns).  A test double,
never used by a server; where SGLang imports, nothing is installed.
"""

from __future__ import annotations

import ast
import types
from pathlib import Path

from tests.support.standin import module

FILES = {
    "sglang.srt.mem_cache.hicache_storage":
        ("srt/mem_cache/hicache_storage.py", ["PoolName", "PoolHitPolicy", "PoolTransfer",
                                                "HiCacheStorageConfig", "HiCacheStorage"]),
    "sglang.srt.mem_cache.unified_cache.unified_cache_linker":
        ("srt/mem_cache/unified_cache/unified_cache_linker.py",
         ["LayerWiseLoadCounter", "UnifiedCacheLinker"]),
}


def get_device_module():
    """SGLang's ``sglang.srt.utils.get_device_module`` for CUDA and CPU."""
    import torch
    return torch.cuda if torch.cuda.is_available() else torch.cpu


def _exec_classes(name: str, path: Path, wanted: list[str]) -> types.ModuleType:
    """Run ``path``'s non-SGLang imports and its classes in ``wanted`` as module ``name``."""
    tree = ast.parse(path.read_text(), str(path))
    keep, found = [], set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("sglang"):
            keep.append(node)
        elif isinstance(node, ast.Import) and not any(a.name.startswith("sglang")
                                                      for a in node.names):
            keep.append(node)
        elif isinstance(node, ast.ClassDef) and node.name in wanted:
            keep.append(node)
            found.add(node.name)
    missing = sorted(set(wanted) - found)
    if missing:
        raise ImportError(f"{path} has no class {', '.join(missing)}: not SGLang 0.5.23's file")
    mod = module(name)
    mod.__file__, mod.__flatcake_from_source__ = str(path), True
    code = compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec")
    exec(code, mod.__dict__)           # noqa: S102 - SGLang's own source, the caller's copy
    return mod


def load_linker_contract(src: str | Path) -> bool:
    """Install SGLang's linker contract from source tree ``src`` (the folder holding
    ``srt/``); True when the contract in use came from source (now or by an earlier call),
    False, installing nothing, when SGLang itself imports."""
    try:
        import sglang.srt.mem_cache.unified_cache.unified_cache_linker as mod
        return bool(vars(mod).get("__flatcake_from_source__"))     # our own marker, not SGLang's
    except ImportError:
        pass
    root = Path(src)
    utils = module("sglang.srt.utils")
    utils.get_device_module = get_device_module
    (storage_name, (storage_file, storage_classes)), \
        (linker_name, (linker_file, linker_classes)) = FILES.items()
    storage = _exec_classes(storage_name, root / storage_file, storage_classes)
    linker = module(linker_name)
    linker.PoolName, linker.PoolTransfer = storage.PoolName, storage.PoolTransfer
    linker.device_module = get_device_module()
    _exec_classes(linker_name, root / linker_file, linker_classes)
    return True
