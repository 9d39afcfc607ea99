"""``flatcake patch``: check that the installed SGLang is the one flatcake's hooks were made for.

flatcake changes SGLang 0.5.23 only through runtime hooks registered by its
``sglang.srt.plugins`` entry point (``sglang/plugin.py``); ``patches/`` holds
source diffs only for what a hook cannot do cleanly, and today there are none.
This command is idempotent: it checks the SGLang version, applies (``patch -p1
--forward``) or verifies each ``patches/sglang-0.5.23/*.diff``, and resolves
every hook target, saying plainly what it found or why it refuses.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

SGLANG_VERSION = "0.5.23"
PATCH_DIR = Path(__file__).resolve().parents[2] / "patches" / f"sglang-{SGLANG_VERSION}"
HOOK_TARGETS = (
    "sglang.srt.server_args.ServerArgs.add_cli_args",
    "sglang.srt.server_args.ServerArgs.from_cli_args",
    "sglang.srt.mem_cache.storage.backend_factory.StorageBackendFactory._create_builtin_backend",
    "sglang.srt.managers.cache_controller.HiCacheController.attach_storage_backend",
    "sglang.srt.managers.cache_controller.HiCacheController._page_backup",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.write_backup_storage",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache._execute_and_commit_kv_backup",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController.write_storage",
    "sglang.srt.mem_cache.pool_host.base.HostKVCache.__init__",
    "sglang.srt.arg_groups.hicache_hook.resolve_layout_io_compatibility",
    "sglang.srt.managers.scheduler.Scheduler._prefetch_kvcache",
    "sglang.srt.managers.scheduler.Scheduler._get_new_batch_prefill_raw",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.check_prefetch_progress",
)


def run(dry_run: bool = False) -> int:
    try:
        from importlib.metadata import version
        installed = version("sglang")
    except Exception:
        print("flatcake patch: refused: sglang is not installed (pip install 'sglang-flatcake[sglang]')")
        return 2
    if installed != SGLANG_VERSION:
        print(f"flatcake patch: refused: installed sglang is {installed}; flatcake's hooks and "
              f"patches were made against sglang=={SGLANG_VERSION}")
        return 2
    import sglang
    root = Path(sglang.__file__).resolve().parent.parent
    diffs = sorted(PATCH_DIR.glob("*.diff")) if PATCH_DIR.exists() else []
    rc = 0
    for d in diffs:
        check_rev = subprocess.run(["patch", "-p1", "--dry-run", "-R", "-s", "-d", str(root), "-i", str(d)],
                                   capture_output=True, text=True)
        if check_rev.returncode == 0:
            print(f"  {d.name}: already applied")
            continue
        check = subprocess.run(["patch", "-p1", "--dry-run", "--forward", "-s", "-d", str(root), "-i", str(d)],
                               capture_output=True, text=True)
        if check.returncode != 0:
            print(f"  {d.name}: does not apply: {check.stdout.strip() or check.stderr.strip()}")
            rc = 2
            continue
        if dry_run:
            print(f"  {d.name}: would apply")
        else:
            subprocess.run(["patch", "-p1", "--forward", "-s", "-d", str(root), "-i", str(d)], check=True)
            print(f"  {d.name}: applied")
    if not diffs:
        print(f"flatcake patch: sglang {installed} found; no source patches are needed "
              f"(everything is done by runtime hooks).")
    missing = []
    for t in HOOK_TARGETS:
        try:
            pkgutil.resolve_name(t)
        except Exception as e:
            missing.append(f"{t} ({type(e).__name__}: {e})")
    if missing:
        print("flatcake patch: these hook targets are missing in this sglang:\n  " + "\n  ".join(missing))
        return 2
    print(f"flatcake patch: all {len(HOOK_TARGETS)} hook targets resolve; plugin entry point "
          "'flatcake' is registered under sglang.srt.plugins.")
    return rc


if __name__ == "__main__":
    sys.exit(run())
