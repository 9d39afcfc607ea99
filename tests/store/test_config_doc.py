"""docs/configuration.md is generated from the settings' fields and kept current."""

import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

from sglang_flatcake.config import FlatCakeConfig
from sglang_flatcake.config_doc import REGENERATE, markdown

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
DOC = ROOT / "docs" / "configuration.md"


def test_the_reference_page_is_the_generated_one():
    assert DOC.read_text() == markdown(), f"docs/configuration.md is stale: run {REGENERATE}"


def test_the_page_has_one_row_per_setting_with_its_default_and_help():
    text = markdown()
    rows = re.findall(r"^\| `(--flatcake-[a-z0-9-]+)`<br>`([a-z0-9_]+)` \| ([^|]+) \|", text, re.M)
    assert [r[1] for r in rows] == [f.name for f in fields(FlatCakeConfig)]
    for flag, name, _default in rows:
        assert flag == "--flatcake-" + name.replace("_", "-")
    by_name = {r[1]: r[2].strip() for r in rows}
    assert by_name["memory_bytes"] == "`4GiB`" and by_name["durable"] == "`true`"
    assert by_name["queue_aging"] == "`0.5`" and by_name["ssd_path"] == '`""`'
    for f in fields(FlatCakeConfig):                      # the help, whitespace folded
        assert " ".join(f.metadata["help"].split()).replace("|", "\\|") in text
    assert "error: --flatcake-high-watermark=1.7 is not allowed: expected a fraction" in text


def test_the_module_main_prints_the_page():
    out = subprocess.run([sys.executable, "-m", "sglang_flatcake.config_doc", "--markdown"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout == markdown()
    bare = subprocess.run([sys.executable, "-m", "sglang_flatcake.config_doc"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert bare.returncode == 2 and "--markdown" in bare.stdout
