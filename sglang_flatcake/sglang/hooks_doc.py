"""``docs/sglang-hooks.md``, generated from the tables of ``hooks.py``.

Regenerate with ``python -m sglang_flatcake.sglang.hooks_doc > docs/sglang-hooks.md``; a test
fails when the page and the tables differ.
"""

from __future__ import annotations

import sys

from .hooks import HOOKS, KEPT_DEFAULTS, MEMBERS, PRIVATE, SGLANG_VERSION, WRITES

DOC_PATH = "docs/sglang-hooks.md"


def render_doc() -> str:
    """The page, from ``HOOKS``, ``MEMBERS``, ``KEPT_DEFAULTS``, ``PRIVATE`` and ``WRITES``."""
    lines = [
        "# SGLang hooks",
        "",
        "<!-- generated from sglang_flatcake/sglang/hooks.py by "
        "`python -m sglang_flatcake.sglang.hooks_doc > docs/sglang-hooks.md`; "
        "tests fail when it drifts -->",
        "",
        f"flatcake changes SGLang {SGLANG_VERSION} only through runtime hooks registered by its "
        "`sglang.srt.plugins` entry point (`sglang_flatcake/sglang/plugin.py`); each is a no-op "
        "unless `--hicache-storage-backend flatcake` is selected or the server runs on a CPU "
        "device.  At start (in every SGLang process that loads plugins) each target is resolved "
        "and its parameters compared with the ones below, and every SGLang member the adapter "
        "reads is looked up; a mismatch stops the launch with one line naming it and the SGLang "
        "version.  `flatcake patch` runs the same check and lists every mismatch.",
        "",
        f"## Hooks ({len(HOOKS)})",
        "",
        "| target | kind | handler | why |",
        "|---|---|---|---|",
    ]
    for h in HOOKS:
        only = " (CPU only)" if h.cpu_only else ""
        lines.append(f"| `{h.short}`{only} | {h.kind} | `{h.handler}` | {h.why} |")
    lines += ["", "Full targets and the parameters checked at start:", ""]
    for h in HOOKS:
        lines.append(f"- `{h.target}({', '.join(h.params)})`")
    lines += ["", f"## SGLang members read ({sum(map(len, MEMBERS.values()))})", "",
              "Read as plain attributes (no defaults), and checked at start:", ""]
    for owner, names in MEMBERS.items():
        lines.append(f"- `{owner}`: {', '.join(f'`{n}`' for n in names)}")
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
              "\"sglang_flatcake.sglang.backend\", \"FlatCakeStorage\")`.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render_doc())
