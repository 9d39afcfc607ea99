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


SA = "sglang.srt.server_args.ServerArgs"


def test_no_row_of_the_table_shadows_another():
    """The table is rows, not dict keys: a second row for an owner adds to the first (the old
    dict named ``ServerArgs`` twice and lost the linker's five fields)."""
    assert hooks.repeated() == []
    assert len({h.target for h in hooks.HOOKS}) == len(hooks.HOOKS)
    twice = hooks.READS + (hooks.READS[0],)
    assert hooks.repeated(twice) == [f"{hooks.READS[0].mode}: {hooks.READS[0].owner} has two "
                                     "rows"] + [f"{hooks.READS[0].mode}: {hooks.READS[0].owner}."
                                                f"{n} is listed twice"
                                                for n in hooks.READS[0].names]
    two_rows = (hooks.Reads("a.B", ("x",), "cli"), hooks.Reads("a.B", ("y", "x"), "cli"))
    assert hooks.members_of(reads=two_rows) == {"a.B": ("x", "y")}


def test_every_server_args_field_the_adapter_reads_is_checked():
    checked = set(hooks.MEMBERS[SA])
    assert {"served_model_name", "model_path", "enable_unified_cache_external_linker",
            "unified_cache_external_linker_config", "unified_cache_external_linker_backend",
            "hicache_storage_backend", "hicache_storage_backend_extra_config", "device",
            "hicache_io_backend", "hicache_mem_layout", "enable_metrics"} <= checked
    assert "served_model_name" in hooks.members_of(("linker",))[SA]
    assert SA not in hooks.members_of(("hicache",))


def test_a_bad_mode_is_refused_with_its_name():
    with pytest.raises(ValueError, match="'hicahce'"):
        hooks.Hook("a.B.c", "after", "plugin:x", (), "why", "hicahce")
    with pytest.raises(ValueError, match="flatcake mode 'lnker' is unknown"):
        hooks.start(("cli", "lnker"), Recorder(), Kinds, set())


def test_each_mode_registers_exactly_its_rows_once():
    pytest.importorskip("sglang.srt.managers.scheduler")
    rec, done = Recorder(), set()
    hooks.start(("cli", "linker"), rec, Kinds, done)
    assert [(t, k) for t, _, k in rec.calls] == \
        [(h.target, h.kind) for h in hooks.HOOKS if h.mode in ("cli", "linker")]
    assert all(fn is hooks.handler(h) for (_, fn, _), h in
               zip(rec.calls, hooks.hooks_of(("cli", "linker"))))
    rec.calls.clear()
    hooks.start(("cli", "hicache", "cpu", "timeline"), rec, Kinds, done)   # cli's are in already
    assert [t for t, _, _ in rec.calls] == [h.target for h in hooks.HOOKS
                                            if h.mode in ("hicache", "cpu", "timeline")]
    assert done == {h.target for h in hooks.HOOKS}


def test_a_mismatch_stops_only_the_mode_that_uses_it(monkeypatch, capsys):
    """A changed private method only HiCache mode hooks does not stop a linker server."""
    pytest.importorskip("sglang.srt.managers.scheduler")
    import dataclasses

    from sglang_flatcake.sglang import hook_table
    i = next(i for i, h in enumerate(hooks.HOOKS) if h.target.endswith("._prefetch_kvcache"))
    changed = dataclasses.replace(hooks.HOOKS[i], params=("self", "req"))
    monkeypatch.setattr(hook_table, "HOOKS", hooks.HOOKS[:i] + (changed,) + hooks.HOOKS[i + 1:])
    rec = Recorder()
    hooks.start(("cli", "linker"), rec, Kinds, set())
    assert len(rec.calls) == len(hooks.hooks_of(("cli", "linker"))) > 0
    rec.calls.clear()
    with pytest.raises(SystemExit) as e:
        hooks.start(("cli", "hicache"), rec, Kinds, set())
    assert e.value.code == 2 and rec.calls == []
    err = capsys.readouterr().err
    assert "(cli+hicache)" in err and "Scheduler._prefetch_kvcache takes" in err


# -- what the code reaches is what the table names (AST scans of sglang/*.py) -----------

def _scan():
    """(module:qualname, node) for every node of the adapter's modules."""
    for path in sorted(ADAPTER.rglob("*.py")):
        mod = ".".join(path.relative_to(ADAPTER).with_suffix("").parts)
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
import os, sys
os.environ["SGLANG_FLATCAKE_MODES"] = sys.argv[1]      # what the launcher hands its children
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
    stops a HiCache-mode process before registering anything, with one line; a linker-mode
    process and one that runs no flatcake mode do not use the changed method and start."""
    pytest.importorskip("sglang.srt.plugins")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SGLANG_PLUGINS": "flatcake"}

    def launch(modes):
        return subprocess.run([sys.executable, "-c", MISMATCHED_LAUNCH, modes],
                              capture_output=True, text=True, timeout=900, env=env)
    r = launch("cli,hicache")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "STARTED" not in r.stdout
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("flatcake:")]
    assert len(line) == 1, r.stderr[-3000:]
    assert "Scheduler._prefetch_kvcache takes (self, req, storage_hit_end, new_arg)" in line[0]
    assert f"sglang {hooks.sglang_version()}" in line[0]
    for modes, hooked in (("cli,linker", "PrefillAdder.add_one_req"), ("", "from_cli_args")):
        r = launch(modes)
        assert r.returncode == 0, r.stderr[-3000:]
        assert hooked in r.stdout and "_prefetch_kvcache" not in r.stdout, r.stdout


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
