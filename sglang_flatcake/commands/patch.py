"""``flatcake patch``: check that the installed SGLang is the one flatcake's hooks were made for.

flatcake changes SGLang 0.5.23 only through runtime hooks registered by its
``sglang.srt.plugins`` entry point (``sglang/plugin.py``); ``patches/`` holds
source diffs only for what a hook cannot do cleanly, and today there are none.
This command is idempotent: it checks the SGLang version, applies (``patch -p1
--forward``) or verifies each ``patches/sglang-0.5.23/*.diff``, and runs the
start-time check of ``sglang/hooks.py`` (every hook target with its parameters,
every SGLang member the adapter reads), listing every mismatch.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ..sglang.hooks import SGLANG_VERSION

PATCH_DIR = Path(__file__).resolve().parents[2] / "patches" / f"sglang-{SGLANG_VERSION}"


def run(dry_run: bool = False) -> int:
    from importlib.metadata import PackageNotFoundError, version
    try:
        installed = version("sglang")
    except PackageNotFoundError:
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
    from ..sglang import hooks
    problems = hooks.check()
    if problems:
        print("flatcake patch: the installed sglang does not match flatcake's hook table "
              "(sglang_flatcake/sglang/hooks.py):\n  " + "\n  ".join(problems))
        return 2
    print(f"flatcake patch: all {len(hooks.HOOKS)} hook targets resolve with the parameters "
          f"they were written for, and all {sum(map(len, hooks.MEMBERS.values()))} SGLang "
          "members flatcake reads exist; plugin entry point 'flatcake' is registered under "
          "sglang.srt.plugins.")
    return rc


if __name__ == "__main__":
    sys.exit(run())
