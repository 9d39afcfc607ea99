"""The demo's tiny model: cached by its parameters in a private folder, built quietly, once.

Real builds (torch, transformers, tokenizers); the model is small, a build takes seconds.
"""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import threading

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from sglang_flatcake.commands import tiny_model as tm  # noqa: E402


def test_built_once_then_reused_and_rebuilt_only_when_different(tmp_path):
    root = tmp_path / "cache"
    path, built = tm.cached_tiny_llama(root, max_positions=4096)
    assert built and path.parent == root
    assert all((path / p).is_file() for p in tm.PARTS)
    assert os.stat(root).st_mode & 0o777 == 0o700
    stamp = os.stat(path / "model.safetensors").st_mtime_ns
    again, built = tm.cached_tiny_llama(root, max_positions=4096)
    assert (again, built) == (path, False)
    assert os.stat(path / "model.safetensors").st_mtime_ns == stamp, "not rebuilt"
    other, built = tm.cached_tiny_llama(root, max_positions=8192)
    assert built and other != path, "other parameters: another model"
    (path / "model.safetensors").unlink()                    # a damaged cache entry
    fixed, built = tm.cached_tiny_llama(root, max_positions=4096)
    assert built and fixed == path and (path / "model.safetensors").is_file()
    assert sorted(p.name for p in root.iterdir()) == sorted([path.name, other.name]), \
        "no temporary or stale folders left behind"


def test_a_cache_entry_from_another_version_is_rebuilt(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    path, _ = tm.cached_tiny_llama(root, max_positions=4096)
    monkeypatch.setattr(tm, "TINY_VERSION", tm.TINY_VERSION + 1)
    newer, built = tm.cached_tiny_llama(root, max_positions=4096)
    assert built and newer != path


def test_concurrent_builds_leave_one_complete_model(tmp_path):
    root = tmp_path / "cache"
    got, errors = [], []

    def build():
        try:
            got.append(tm.cached_tiny_llama(root, max_positions=2048))
        except BaseException as e:          # reported below, not swallowed
            errors.append(e)
    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    paths = {p for p, _ in got}
    assert len(paths) == 1 and len(got) == 3
    (path,) = paths
    assert all((path / p).is_file() for p in tm.PARTS)
    assert [p.name for p in root.iterdir()] == [path.name]


def test_unknown_parameters_are_refused(tmp_path):
    with pytest.raises(TypeError, match="layerz"):
        tm.cached_tiny_llama(tmp_path, layerz=3)


def test_the_build_prints_nothing_on_a_terminal(tmp_path):
    """The tokenizer trainer draws progress bars only on a terminal: run the build on one."""
    main, child = pty.openpty()
    code = ("import sys; from sglang_flatcake.commands.tiny_model import build_tiny_llama; "
            "build_tiny_llama(sys.argv[1])")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "m")],
                            stdout=child, stderr=child, stdin=subprocess.DEVNULL)
    os.close(child)
    out = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:                     # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(main)
    assert proc.wait(timeout=300) == 0, out.decode(errors="replace")[-2000:]
    text = out.decode(errors="replace")
    assert "Compute merges" not in text and "Tokenize words" not in text, text[-2000:]
    assert text.strip() == "", text[-2000:]
