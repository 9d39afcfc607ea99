"""docs/configuration.md, generated from the settings' fields (``help``, ``allowed``, default).

``python -m sglang_flatcake.config_doc --markdown > docs/configuration.md`` writes it;
tests/store/test_config_doc.py fails when the page and the fields disagree.
"""

from __future__ import annotations

import dataclasses
import inspect

from .config import FlatCakeConfig
from .config_check import format_bytes, kind
from .config_groups import GROUPS
from .errors import ConfigError

TITLES = {"placement": "Placement", "media": "Media: memory, SSD, the store on disk",
          "io": "I/O: reading blocks", "sched": "Scheduling", "cluster": "Cluster"}
REGENERATE = "python -m sglang_flatcake.config_doc --markdown > docs/configuration.md"


def flag(name: str) -> str:
    return "--flatcake-" + name.replace("_", "-")


def show_default(f: dataclasses.Field) -> str:
    v = f.default
    if isinstance(v, bool):
        return "`true`" if v else "`false`"
    if f.metadata.get("bytes"):
        return f"`{format_bytes(v)}`"
    return '`""`' if v == "" else f"`{v}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("``", "`").replace("|", "\\|")


def _example_error() -> str:
    try:
        FlatCakeConfig.from_mapping({"high_watermark": "1.7"}, prefix="--flatcake-")
    except ConfigError as e:
        return f"error: {e}"
    raise AssertionError("high_watermark=1.7 was accepted")


def _table(cls: type) -> list[str]:
    rows = ["| flag, extra-config key | default | allowed | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        allowed = f.metadata.get("allowed") or ("true or false" if kind(f) == "bool" else "")
        rows.append(f"| `{flag(f.name)}`<br>`{f.name}` | {show_default(f)} | "
                    f"{_cell(allowed)} | {_cell(f.metadata['help'])} |")
    return rows


def markdown() -> str:
    """The configuration reference, one section and table per consumer."""
    out = [
        "# Configuration",
        "",
        "<!-- Generated from the fields in sglang_flatcake/config_groups.py; do not edit. "
        f"Regenerate: {REGENERATE} (tests/store/test_config_doc.py fails when they disagree). -->",
        "",
        "Every setting is one field of `FlatCakeConfig` (`sglang_flatcake/config.py`): one "
        "frozen config, composed of a part per consumer. Set one",
        "",
        "- on the server, as a flag next to `--hicache-storage-backend flatcake`: "
        "`--flatcake-high-watermark 0.95` (a boolean flag alone means true);",
        "- or as a key of `--hicache-storage-backend-extra-config`: "
        "`'{\"high_watermark\": 0.95}'` (a flag wins over a key);",
        "- in `flatcake replay` and `flatcake tune`, with the same flags: sizes are full size "
        "(scaled with the replay's blocks) and `store_dir` and `ssd_path` are refused;",
        "- in Python: `FlatCakeConfig(high_watermark=0.95)`, "
        "`FlatCakeConfig.from_mapping({\"high-watermark\": \"0.95\"})` or "
        "`FlatCakeConfig.from_parts(PlacementConfig(...), IOConfig(...))`. "
        "`cfg.high_watermark` reads one setting; "
        + ", ".join(f"`cfg.{g}`" for g in GROUPS) + " give each consumer its part.",
        "",
        "Sizes: `65536`, `64KiB`, `4GiB`, `1.5GiB` (KiB, MiB, GiB, TiB count 1024s; kB, MB, GB, "
        "TB 1000s). Booleans: `true`/`false`, `yes`/`no`, `on`/`off`, `1`/`0`.",
        "",
        "A value that is not allowed stops the launch with one line naming it, e.g.",
        "",
        "```",
        _example_error(),
        "```",
        "",
        "A number where a boolean belongs (or the reverse), a list where a string belongs, "
        "and a size past the 48-bit block offset (256TiB) are refused too; `memory_bytes` must "
        "also fit in the machine's memory (`flatcake replay` models another machine and skips "
        "that check).",
    ]
    for name, cls in GROUPS.items():
        out += ["", f"## {TITLES.get(name, name.capitalize())}: `cfg.{name}` (`{cls.__name__}`)",
                "", _cell(inspect.getdoc(cls)), ""]
        out += _table(cls)
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m sglang_flatcake.config_doc --markdown``: print docs/configuration.md."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m sglang_flatcake.config_doc",
                                description="FlatCake's settings")
    p.add_argument("--markdown", action="store_true",
                   help="print the configuration reference (docs/configuration.md)")
    a = p.parse_args(argv)
    if not a.markdown:
        p.print_help()
        return 2
    print(markdown(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
