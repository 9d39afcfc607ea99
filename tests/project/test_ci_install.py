"""The README's commands are what CI runs: ``.ci/run`` installs exactly the extras of the
README's first ``pip install -e '.[EXTRAS]'`` line (nothing besides), those extras bring every
optional package the tests use, and CI's test command is the README's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

import pytest

from tests.support import ROOT

# import name the tests skip without -> the distribution that provides it
OPTIONAL = {"sglang": "sglang", "transformers": "sglang", "pytest_cov": "pytest-cov",
            "hypothesis": "hypothesis", "matplotlib": "matplotlib", "redis": "redis",
            "zmq": "pyzmq", "mooncake": "mooncake-transfer-engine-non-cuda", "msgpack": "msgpack"}
TEST_COMMAND = "python -m pytest -q"


def readme_first_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"^```bash\n(.*?)^```", text, re.S | re.M)
    assert block, "README.md has no ```bash block"
    return block.group(1).splitlines()


def extras_closure(names: list[str]) -> set[str]:
    """Distribution names the extras ``names`` pull in (self-references followed)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    out, todo = set(), list(names)
    while todo:
        for req in extras[todo.pop()]:
            m = re.match(r"([A-Za-z0-9_.\-]+)(\[([^\]]+)\])?", req)
            if m.group(1) == project["name"]:
                todo += m.group(3).split(",")
            else:
                out.add(m.group(1).lower())
    return out


def test_the_readme_opens_with_the_install_line_the_demo_and_the_tests():
    lines = [ln for ln in readme_first_block() if ln and not ln.startswith("#")]
    assert re.fullmatch(r"pip install -e '\.\[[a-z0-9,_-]+\]'", lines[0]), lines[0]
    assert "flatcake demo" in lines and TEST_COMMAND in lines, lines


def test_ci_installs_exactly_the_readme_line(tmp_path):
    install = readme_first_block()[0]
    r = subprocess.run(["bash", str(ROOT / ".ci" / "run"), "--dry-run"], cwd=ROOT,
                       env={**os.environ, "FLATCAKE_CI_CACHE": str(tmp_path),
                            "PYTHON": sys.executable}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert f"pip install -e '{got['spec']}'" == install
    assert got["venv"].startswith(str(tmp_path) + "/venv-")      # cached outside the clone
    assert list(tmp_path.iterdir()) == []                          # a dry run builds nothing
    ci = (ROOT / ".ci" / "run").read_text()
    installs = re.findall(r"pip\" install [^\n]*", ci)
    assert installs and all('"$spec"' in i or "--no-deps" in i for i in installs), installs
    assert ci.rstrip().splitlines()[-1] == TEST_COMMAND


def test_the_readme_line_brings_every_optional_package_the_tests_use():
    spec = re.search(r"\[([a-z0-9,_-]+)\]", readme_first_block()[0]).group(1)
    have = extras_closure(spec.split(","))
    missing = sorted({dist for dist in OPTIONAL.values() if dist not in have})
    assert not missing, f"the README's install line does not install {missing}"


@pytest.mark.parametrize("extra,dist", [("test", "redis"), ("sglang", "pyzmq")])
def test_the_closure_check_notices_a_missing_package(extra, dist):
    assert dist not in extras_closure([extra])
