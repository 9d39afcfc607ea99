"""The hook table (``sglang/hooks.py``): one source for ``register()``, ``flatcake patch`` and
``docs/sglang-hooks.md``, checked against the installed SGLang before anything is hooked."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_flatcake.sglang import hooks, hooks_doc

ROOT = Path(__file__).resolve().parents[2]
ADAPTER = ROOT / "sglang_flatcake" / "sglang"


# -- the table and what is generated from it (no SGLang needed) ------------------------

def test_the_doc_is_the_table():
    """docs/sglang-hooks.md is generated from the table; regenerate it when this fails:
    ``python -m sglang_flatcake.sglang.hooks_doc > docs/sglang-hooks.md``."""
    assert (ROOT / hooks_doc.DOC_PATH).read_text() == hooks_doc.render_doc()


def test_patches_readme_points_to_the_doc():
    assert "docs/sglang-hooks.md" in (ROOT / "patches" / "README.md").read_text()


def test_every_handler_resolves_and_takes_what_its_kind_passes():
    for h in hooks.HOOKS:
        fn = hooks.handler(h)
        first = next(iter(__import__("inspect").signature(fn).parameters))
        want = {"around": "original", "after": "result"}.get(h.kind)
        assert want is None or first == want, (h.handler, first)
    assert len({h.target for h in hooks.HOOKS}) == len(hooks.HOOKS)


class Recorder:
    def __init__(self):
        self.calls = []

    def register(self, target, fn, kind):
        self.calls.append((target, fn, kind))


class Kinds:
    BEFORE, AFTER, AROUND = "before", "after", "around"


def test_register_all_registers_exactly_the_table():
    cpu, gpu = Recorder(), Recorder()
    hooks.register_all(cpu, Kinds, accelerator=False)
    hooks.register_all(gpu, Kinds, accelerator=True)
    assert [(t, k) for t, _, k in cpu.calls] == [(h.target, h.kind) for h in hooks.HOOKS]
    assert [t for t, _, _ in gpu.calls] == [h.target for h in hooks.HOOKS if not h.cpu_only]
    assert all(fn is hooks.handler(h) for (_, fn, _), h in zip(cpu.calls, hooks.HOOKS))


# -- what the code reaches is what the table names (AST scans of sglang/*.py) -----------

def _scan():
    """(module:qualname, node) for every node of the adapter's modules."""
    for path in sorted(ADAPTER.glob("*.py")):
        mod = path.stem
        tree = ast.parse(path.read_text())
        stack: list[str] = []

        def walk(node):
            named = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            if named:
                stack.append(node.name)
            yield f"{mod}:{'.'.join(stack)}", node
            for child in ast.iter_child_nodes(node):
                yield from walk(child)
            if named:
                stack.pop()
        yield from walk(tree)


def test_every_private_reach_in_is_named_in_one_place():
    """Private members of objects the adapter does not own (``x._name`` with ``x`` not
    ``self``/``cls``) and private hook targets: exactly ``hooks.PRIVATE``."""
    found = {node.attr for _, node in _scan()
             if isinstance(node, ast.Attribute) and node.attr.startswith("_")
             and not node.attr.startswith("__")
             and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))}
    found |= {h.target.rsplit(".", 1)[1] for h in hooks.HOOKS
              if h.target.rsplit(".", 1)[1].startswith("_")
              and not h.target.endswith("__init__")}
    assert found == {r.name for r in hooks.PRIVATE}
    assert len(hooks.PRIVATE) <= 11     # + the failure injector's wrapped backend


def test_every_getattr_with_a_default_is_listed_and_harmless():
    found = {(where, ast.unparse(node)) for where, node in _scan()
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id == "getattr" and len(node.args) == 3}
    assert found == {(w, read) for w, read, _ in hooks.KEPT_DEFAULTS}


# -- against the installed SGLang ----------------------------------------------------------

def test_the_installed_sglang_matches_the_table():
    pytest.importorskip("sglang.srt.managers.scheduler")
    assert hooks.check() == []


def test_a_changed_signature_or_member_stops_with_one_line(capsys):
    pytest.importorskip("sglang.srt.managers.scheduler")
    import dataclasses
    h = hooks.HOOKS[5]                          # write_backup_storage(self, node_id)
    changed = dataclasses.replace(h, params=("self", "node_id", "priority"))
    gone = dataclasses.replace(h, target=h.target + "_v2")
    with pytest.raises(SystemExit) as e:
        hooks.check_or_exit((changed, gone), members={})
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert h.target in err and "(self, node_id)" in err and "(and 1 more)" in err
    assert f"in sglang {hooks.sglang_version()}" in err
    assert hooks.check((), {"sglang.srt.managers.scheduler.Scheduler": ("waiting_queue_v2",)}) \
        == ["sglang.srt.managers.scheduler.Scheduler.waiting_queue_v2 is missing "
            "(flatcake reads it)"]


MISMATCHED_LAUNCH = r"""
import sglang.srt.managers.scheduler as s
def _prefetch_kvcache(self, req, storage_hit_end, new_arg=None):
    pass
s.Scheduler._prefetch_kvcache = _prefetch_kvcache      # "a different SGLang"
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
print("STARTED HALF-HOOKED:", sorted(HookRegistry._patched))
"""


@pytest.mark.slow
def test_a_mismatched_sglang_stops_the_launch_through_sglangs_own_loader():
    """SGLang's ``load_plugins`` only logs a hook it cannot apply; flatcake's entry point
    stops the process before registering anything, with one line."""
    pytest.importorskip("sglang.srt.plugins")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SGLANG_PLUGINS": "flatcake"}
    r = subprocess.run([sys.executable, "-c", MISMATCHED_LAUNCH], capture_output=True,
                       text=True, timeout=900, env=env)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "STARTED" not in r.stdout
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("flatcake:")]
    assert len(line) == 1, r.stderr[-3000:]
    assert "Scheduler._prefetch_kvcache takes (self, req, storage_hit_end, new_arg)" in line[0]
    assert f"sglang {hooks.sglang_version()}" in line[0]


# -- a mistyped flag --------------------------------------------------------------------

def _parser():
    import argparse
    pytest.importorskip("sglang.srt.server_args")
    from sglang.srt.server_args import ServerArgs

    from sglang_flatcake.sglang import plugin
    p = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(p)
    plugin._add_cli_args_after(None, p)
    return p


def test_a_mistyped_flatcake_flag_gets_one_line_naming_the_closest(capsys):
    p = _parser()
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--model-path", "m", "--flatcake-hig-watermark", "0.8"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == ("error: unrecognized argument --flatcake-hig-watermark; "
                   "did you mean --flatcake-high-watermark?\n")
    with pytest.raises(SystemExit):
        p.parse_args(["--model-path", "m", "--flatcake-zzzzzz=1"])
    assert capsys.readouterr().err.startswith("error: unrecognized argument --flatcake-zzzzzz; "
                                              "see --help")
    with pytest.raises(SystemExit):                 # not ours: SGLang's own error, usage and all
        p.parse_args(["--model-path", "m", "--no-such-flag"])
    assert "usage:" in capsys.readouterr().err


@pytest.mark.slow
def test_launch_server_with_a_typo_prints_one_line_not_the_usage(tmp_path):
    pytest.importorskip("sglang.launch_server")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path",
                        str(tmp_path), "--flatcake-hig-watermark", "0.8"],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 2
    assert "did you mean --flatcake-high-watermark?" in r.stderr
    assert "usage:" not in r.stderr and len(r.stderr.splitlines()) < 20, r.stderr[-3000:]


# -- flatcake patch reads the same table ------------------------------------------------------

def test_flatcake_patch_checks_the_table(capsys, monkeypatch):
    pytest.importorskip("sglang.srt.managers.scheduler")
    from sglang_flatcake.commands import patch
    assert patch.run(dry_run=True) == 0
    assert f"all {len(hooks.HOOKS)} hook targets resolve" in capsys.readouterr().out
    monkeypatch.setattr(hooks, "check", lambda: ["hook target a.B.c is missing", "x.Y.z is "
                                                 "missing (flatcake reads it)"])
    assert patch.run(dry_run=True) == 2
    out = capsys.readouterr().out
    assert "  hook target a.B.c is missing\n  x.Y.z is missing" in out
