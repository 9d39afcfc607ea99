"""No module reads another object's private members: an AST scan of the package.

A *reach-in* is an attribute access ``x._name`` (single leading underscore, not a
dunder) where ``x`` is not ``self``, ``cls`` or ``super()``: code using a member its
owner kept to itself.  The SGLang adapter (``sglang_flatcake/sglang/``) must use some of
SGLang's privates; those are counted and listed on their own.  Run as a script
(``python tests/project/test_private_reach.py``) it prints every reach-in.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sglang_flatcake

PKG = Path(sglang_flatcake.__file__).resolve().parent
ADAPTER = "sglang/"
TOTAL_BUDGET = 8          # the whole package, the adapter included (issue 22)
CORE_BUDGET = 1           # outside the adapter: tiers/memory.py's tensor keep-alive


def reach_ins(source: str, name: str = "<src>") -> list[str]:
    """``"name:line: expr"`` for each reach-in in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        a = node.attr
        if not a.startswith("_") or (a.startswith("__") and a.endswith("__")):
            continue
        v = node.value
        if isinstance(v, ast.Name) and v.id in ("self", "cls"):
            continue
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
            continue
        out.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return sorted(out, key=lambda s: (s.split(":")[0], int(s.split(":")[1])))


def package_reach_ins() -> tuple[list[str], list[str]]:
    """(reach-ins outside the SGLang adapter, reach-ins in it)."""
    core, adapter = [], []
    for p in sorted(PKG.rglob("*.py")):
        rel = str(p.relative_to(PKG))
        found = reach_ins(p.read_text(), rel)
        (adapter if rel.startswith(ADAPTER) else core).extend(found)
    return core, adapter


def test_the_scan_finds_a_reach_in_and_spares_self_cls_and_super():
    src = ("class A(B):\n"
           "    def f(self, other):\n"
           "        self._mine = other._theirs\n"
           "        super()._g()\n"
           "        return cls._h, self.x._deep, other.__len__\n")
    assert reach_ins(src) == ["<src>:3: other._theirs", "<src>:5: self.x._deep"]


def test_private_reach_ins_stay_within_the_budget():
    core, adapter = package_reach_ins()
    listing = "\n  ".join(["outside the adapter:"] + core + ["SGLang adapter:"] + adapter)
    assert len(core) <= CORE_BUDGET, f"{len(core)} reach-ins outside the adapter:\n  {listing}"
    assert len(core) + len(adapter) <= TOTAL_BUDGET, \
        f"{len(core) + len(adapter)} reach-ins in the package:\n  {listing}"


def test_the_store_and_its_paths_never_reach_into_each_other():
    core, _ = package_reach_ins()
    store_paths = ("store", "read/", "tiers/region", "tiers/ssd", "io/uring", "replay/cluster",
                   "session_table", "sessions", "reclaimer", "recovery", "results")
    bad = [r for r in core if r.startswith(store_paths)]
    assert bad == [], "\n".join(bad)


if __name__ == "__main__":
    core, adapter = package_reach_ins()
    print(f"{len(core)} outside the SGLang adapter (budget {CORE_BUDGET}):")
    print("\n".join(f"  {r}" for r in core))
    print(f"{len(adapter)} in the SGLang adapter (sglang_flatcake/{ADAPTER}):")
    print("\n".join(f"  {r}" for r in adapter))
    print(f"total {len(core) + len(adapter)} (budget {TOTAL_BUDGET})")
