"""``docs/sglang-hooks.md``, generated from the tables of ``hook_table.py``.

Regenerate with ``python -m sglang_flatcake.sglang.hooks_doc > docs/sglang-hooks.md``; a test
fails when the page and the tables differ.
"""

from __future__ import annotations

import sys

from .hook_table import (HOOKS, KEPT_DEFAULTS, MEMBERS, MODES, PRIVATE, READS, SGLANG_VERSION,
                         WRITES)

DOC_PATH = "docs/sglang-hooks.md"


def render_doc() -> str:
    """The page, from ``HOOKS``, ``READS``, ``KEPT_DEFAULTS``, ``PRIVATE`` and ``WRITES``."""
    lines = [
        "# SGLang hooks",
        "",
        "<!-- generated from sglang_flatcake/sglang/hook_table.py by "
        "`python -m sglang_flatcake.sglang.hooks_doc > docs/sglang-hooks.md`; "
        "tests fail when it drifts -->",
        "",
        f"flatcake changes SGLang {SGLANG_VERSION} only through runtime hooks registered by its "
        "`sglang.srt.plugins` entry point (`sglang_flatcake/sglang/plugin.py`), by mode: "
        "`cli` in every process that loads the plugin (the flags that select flatcake); "
        "`hicache` with `--hicache-storage-backend flatcake`; `linker` with `FlatCakeLinker` "
        "as the external linker; `cpu` for HiCache (any backend) on a server without an "
        "accelerator.  The launcher picks the modes from its parsed flags and hands them to "
        "the processes it starts (`SGLANG_FLATCAKE_MODES`); a server that selects no flatcake "
        "mode gets only the `cli` rows.  At each mode's start its hook targets are resolved "
        "and their parameters compared with the ones below, and the SGLang members it reads "
        "are looked up; a mismatch stops the launch with one line naming it and the SGLang "
        "version, before that mode registers a hook.  `flatcake patch` checks every mode and "
        "lists every mismatch.",
        "",
        f"## Hooks ({len(HOOKS)})",
        "",
        "| target | mode | kind | handler | why |",
        "|---|---|---|---|---|",
    ]
    for h in HOOKS:
        lines.append(f"| `{h.short}` | {h.mode} | {h.kind} | `{h.handler}` | {h.why} |")
    lines += ["", "Full targets and the parameters checked at start:", ""]
    for h in HOOKS:
        lines.append(f"- `{h.target}({', '.join(h.params)})`")
    lines += ["", f"## SGLang members read ({sum(map(len, MEMBERS.values()))})", "",
              "Read as plain attributes (no defaults), and checked at the start of the mode "
              "that reads them:", ""]
    for mode in MODES:
        for r in (r for r in READS if r.mode == mode):
            lines.append(f"- {mode}: `{r.owner}`: {', '.join(f'`{n}`' for n in r.names)}")
    lines += ["", f"## Reads with a default ({len(KEPT_DEFAULTS)})", "",
              "Every other SGLang member is read without a default; these few keep one:", "",
              "| where | read | why the default is harmless |", "|---|---|---|"]
    for where, read, why in KEPT_DEFAULTS:
        lines.append(f"| `{where}` | `{read}` | {why} |")
    lines += ["", f"## Private names of others touched ({len(PRIVATE)})", "",
              "| name | where | why |", "|---|---|---|"]
    for r in PRIVATE:
        lines.append(f"| `{r.name}` | `{r.where}` | {r.why} |")
    lines += ["", f"## SGLang state written ({len(WRITES)})", "",
              "| where | what | why |", "|---|---|---|"]
    for where, what, why in WRITES:
        lines.append(f"| `{where}` | {what} | {why} |")
    lines += ["", "The backend itself is registered with the public "
              "`StorageBackendFactory.register_backend(\"flatcake\", "
              "\"sglang_flatcake.sglang.hicache.backend\", \"FlatCakeStorage\")`.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render_doc())
