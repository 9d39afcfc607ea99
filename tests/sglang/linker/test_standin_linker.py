"""``standin_linker``: SGLang's linker contract run from SGLang's own source files, as the
GPU machine (no SGLang) runs it.  A subprocess blocks ``import sglang`` and loads the
classes from the installed SGLang's files; they must be those files' classes, behave as
the real ones, and carry the linker's data path on the emulated device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

real = pytest.importorskip("sglang.srt.mem_cache.unified_cache.unified_cache_linker")

BLOCKED = '''
import json, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "sglang" or name.startswith("sglang."):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
sys.path.insert(0, sys.argv[2])
from tests.support.standin_linker import load_linker_contract
installed = load_linker_contract(sys.argv[1])
from sglang.srt.mem_cache.unified_cache import unified_cache_linker as u
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
c = u.LayerWiseLoadCounter(2)
i = c.update_producer()
c.complete(i, 0)
c.fail(i, RuntimeError("x"))
out = {"installed": installed, "file": u.__file__, "finish": c.finish(i),
       "fields": sorted(PoolTransfer.__dataclass_fields__), "kv": PoolName.KV.value}
if len(sys.argv) > 3:
    import torch
    from sglang_flatcake.read import device as dv
    import gpu_linker
    r = gpu_linker.linker_flow(dv.EMULATED, torch, sys.argv[3], sys.argv[1])
    out["flow"] = {"ok": r["ok"], "from_source": r["sglang_from_source"]}
print(json.dumps(out))
'''


def sglang_src() -> Path:
    return Path(real.__file__).parents[3]          # .../site-packages/sglang


def run(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-c", BLOCKED, *args], capture_output=True, text=True,
                       timeout=600, cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_contract_comes_from_sglangs_files_and_behaves_as_sglangs():
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer
    out = run(str(sglang_src()), str(ROOT))
    assert out["installed"] is True
    assert out["file"].endswith("srt/mem_cache/unified_cache/unified_cache_linker.py")
    assert out["finish"] is False             # a failed layer: finish reports it, as SGLang's
    assert out["fields"] == sorted(PoolTransfer.__dataclass_fields__) and out["kv"] == "kv"


def test_the_linker_flow_runs_on_the_contract_from_source(tmp_path):
    out = run(str(sglang_src()), str(ROOT / "benchmarks"), str(tmp_path))
    assert out["flow"] == {"ok": True, "from_source": True}


def test_a_file_of_another_sglang_is_refused_by_name(tmp_path):
    from tests.support.standin_linker import FILES, _exec_classes
    name, (rel, wanted) = next(iter(FILES.items()))
    bad = tmp_path / "hicache_storage.py"
    bad.write_text("class PoolName:\n    pass\n")
    with pytest.raises(ImportError, match="no class .*PoolTransfer"):
        _exec_classes("flatcake_test_module", bad, wanted)


def test_nothing_is_installed_where_sglang_imports(tmp_path):
    from tests.support.standin_linker import load_linker_contract
    assert load_linker_contract(tmp_path) is False     # the real SGLang stays
    assert real.LayerWiseLoadCounter.__module__ == real.__name__
