"""Opening a rank's store (``sglang/rank_store.py``, both modes): the store knows which model
it caches KV for (``model_identity``) and refuses, or starts fresh, for another one."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from tests.support import blocks_for, chain

from sglang_flatcake.errors import LayoutMismatchError
from sglang_flatcake.placement import WriteSignals
from sglang_flatcake.sglang.model_identity import IDENTITY_FILE
from sglang_flatcake.sglang.rank_store import open_rank_store


def model_dir(tmp_path, weights: bytes = b"w" * 1000, config: str = '{"layers": 4}'):
    m = tmp_path / "model"
    m.mkdir(exist_ok=True)
    (m / "config.json").write_text(config)
    (m / "model.safetensors").write_bytes(weights)
    return m


def written(folder, layout, cfg, model, revision=None):
    keys = chain(3)
    with open_rank_store(folder, layout, cfg, str(model), revision) as st:
        st.put(keys, blocks_for(layout, keys), signals=WriteSignals(turn=0))
        assert st.exists(keys) == 3
    return keys


def test_the_same_model_reopens_its_store(tmp_path, layout, config):
    m, folder = model_dir(tmp_path), tmp_path / "s"
    keys = written(folder, layout, config, m)
    assert (folder / IDENTITY_FILE).is_file()
    with open_rank_store(folder, layout, config, str(m)) as st:
        assert st.exists(keys) == 3


def test_new_weights_at_the_same_path_are_refused_with_one_line(tmp_path, layout, config):
    m, folder = model_dir(tmp_path), tmp_path / "s"
    written(folder, layout, config, m)
    model_dir(tmp_path, weights=b"v" * 1000)                       # same names, same sizes
    with pytest.raises(LayoutMismatchError) as e:
        open_rank_store(folder, layout, config, str(m))
    msg = str(e.value)
    assert "another model (weights differ)" in msg and str(folder) in msg
    assert len(msg.splitlines()) == 1
    model_dir(tmp_path, weights=b"v" * 1000, config='{"layers": 5}')   # a new config too
    with pytest.raises(LayoutMismatchError, match=r"\(config, weights differ\)"):
        open_rank_store(folder, layout, config, str(m))


def test_reset_starts_the_store_fresh_and_says_so(tmp_path, layout, config, caplog):
    m, folder = model_dir(tmp_path), tmp_path / "s"
    keys = written(folder, layout, config, m)
    model_dir(tmp_path, weights=b"v" * 1000)
    reset = dataclasses.replace(config, on_layout_mismatch="reset")
    with caplog.at_level(logging.WARNING, logger="sglang_flatcake"):
        with open_rank_store(folder, layout, reset, str(m)) as st:
            assert st.exists(keys) == 0
    line = [r.getMessage() for r in caplog.records if "another model" in r.getMessage()]
    assert len(line) == 1 and "starting it fresh" in line[0] and "weights" in line[0]
    with open_rank_store(folder, layout, config, str(m)) as st:     # recorded: now it matches
        assert st.exists(keys) == 0


def test_a_named_revision_stands_for_the_weights(tmp_path, layout, config):
    m, folder = model_dir(tmp_path), tmp_path / "s"
    keys = written(folder, layout, config, m, revision="r1")
    model_dir(tmp_path, weights=b"v" * 1000)                       # not read: r1 names them
    with open_rank_store(folder, layout, config, str(m), "r1") as st:
        assert st.exists(keys) == 3
    with pytest.raises(LayoutMismatchError, match=r"\(revision differ\)"):
        open_rank_store(folder, layout, config, str(m), "r2")


def test_a_model_name_that_is_no_folder_is_its_identity(tmp_path, layout, config):
    folder = tmp_path / "s"
    written(folder, layout, config, "org/model-a")
    with pytest.raises(LayoutMismatchError, match=r"\(model differ\)"):
        open_rank_store(folder, layout, config, "org/model-b")


WARM = """
import sys
from pathlib import Path
from sglang_flatcake import index
from sglang_flatcake.config import FlatCakeConfig
from sglang_flatcake.layout import KVLayout
from sglang_flatcake.sglang.rank_store import open_rank_store
kernels = [getattr(index, n) for n in dir(index) if n.endswith("_kernel")]
assert kernels and all(not k.signatures for k in kernels), "compiled before the store opened"
layout = KVLayout.mha(layers=2, kv_heads=2, head_dim=8, dtype="float16", page_tokens=4)
cfg = FlatCakeConfig(memory_bytes=1 << 20, ssd_bytes=16 << 20, extent_bytes=1 << 20,
                     durable=False)
with open_rank_store(Path(sys.argv[1]), layout, cfg, "tiny") as st:
    print(sorted(k.__name__ for k in kernels if not k.signatures))
"""


def test_opening_a_servers_store_compiles_every_index_kernel_first(tmp_path):
    """A fresh process: no index kernel is compiled before ``open_rank_store``, every one is
    after it, so no request's first lookup or write compiles (numba's own cache aside)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", WARM, str(tmp_path / "store")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"
