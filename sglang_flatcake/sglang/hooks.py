"""The start-time check of flatcake's hook table against the installed SGLang, per mode.

SGLang's ``HookRegistry.apply_hooks`` only logs a target it cannot resolve, so a different
SGLang would start half-hooked.  ``check`` resolves hook targets and compares their
parameters with the ones each hook was written for, and checks that the SGLang members the
adapter reads still exist; ``start(modes, ...)`` does that for exactly the rows of ``modes``
(``hook_table.MODES``) and stops on the first mismatch with one line naming it and the
installed SGLang version, then registers those modes' hooks.  The table itself is
``hook_table.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import pkgutil
import re
import sys
from typing import Callable

from .hook_table import (HOOKS, KEPT_DEFAULTS, MEMBERS, MODES, PRIVATE, READS,  # noqa: F401
                         SGLANG_VERSION, WRITES, Hook, Reach, Reads, hooks_of, members_of,
                         repeated)


def sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("sglang")
    except PackageNotFoundError:
        return "not installed"


def _raw(obj, attr: str):
    """The attribute as defined (classmethod/staticmethod unwrapped), like ``apply_hooks``."""
    if isinstance(obj, type):
        for klass in obj.__mro__:
            if attr in klass.__dict__:
                raw = klass.__dict__[attr]
                return raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    return getattr(obj, attr)


def params_of(target: str) -> tuple[str, ...]:
    """The parameter names of ``target`` as SGLang defines it (``*args``/``**kw`` marked)."""
    obj_path, attr = target.rsplit(".", 1)
    fn = _raw(pkgutil.resolve_name(obj_path), attr)
    out = []
    for p in inspect.signature(fn).parameters.values():
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        out.append(prefix + p.name)
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _module_source(module: str) -> str:
    return inspect.getsource(sys.modules[module])


def _assigned_in_init(klass: type, name: str) -> bool:
    """Does some SGLang class in ``klass``'s MRO assign ``self.<name>``?  (Instance attributes
    cannot be seen on the class; their assignment in the source can.)"""
    pattern = re.compile(r"\bself\." + re.escape(name) + r"\s*(:[^=\n]+)?=(?!=)")
    for c in klass.__mro__:
        if c.__module__.startswith("sglang.") and pattern.search(_module_source(c.__module__)):
            return True
    return False


def _has_member(owner, name: str) -> bool:
    """A method, property, class attribute, msgspec field, dataclass field (also those with no
    default) or an attribute an SGLang ``__init__`` assigns."""
    if hasattr(owner, name):
        return True
    if dataclasses.is_dataclass(owner) and name in {f.name for f in dataclasses.fields(owner)}:
        return True
    return isinstance(owner, type) and _assigned_in_init(owner, name)


def check(hooks: tuple[Hook, ...] = HOOKS, members: dict | None = None) -> list[str]:
    """One line per hook target that does not resolve or whose parameters changed, and per
    SGLang member the adapter reads that is gone; empty when everything matches."""
    problems = []
    for h in hooks:
        try:
            got = params_of(h.target)
        except (ImportError, AttributeError, ValueError) as e:
            problems.append(f"hook target {h.target} is missing ({type(e).__name__}: {e})")
            continue
        if got != h.params:
            problems.append(f"hook target {h.target} takes ({', '.join(got)}), flatcake's "
                            f"{h.kind} hook was written for ({', '.join(h.params)})")
    for owner_path, names in (MEMBERS if members is None else members).items():
        try:
            owner = pkgutil.resolve_name(owner_path)
        except (ImportError, AttributeError, ValueError) as e:
            problems.append(f"{owner_path} is missing ({type(e).__name__}: {e})")
            continue
        for name in names:
            if not _has_member(owner, name):
                problems.append(f"{owner_path}.{name} is missing (flatcake reads it)")
    return problems


def check_or_exit(hooks: tuple[Hook, ...] = HOOKS, members: dict | None = None,
                  modes: tuple[str, ...] = MODES) -> None:
    """``check``; on a mismatch print one line (the first problem, the modes checked, the
    SGLang version, how many more) and stop the process with status 2, before a single hook
    of ``modes`` is registered.  ``SystemExit``, because SGLang's ``load_plugins`` catches
    (and only logs) an ``Exception`` from a plugin."""
    problems = check(hooks, members)
    if not problems:
        return
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    print(f"flatcake: refusing to start half-hooked ({'+'.join(modes)}): {problems[0]} in "
          f"sglang {sglang_version()} (flatcake is built for sglang {SGLANG_VERSION}){more}; "
          f"run `flatcake patch` for the full list, or leave flatcake out with SGLANG_PLUGINS",
          file=sys.stderr, flush=True)
    raise SystemExit(2)


def handler(h: Hook) -> Callable:
    """The function ``h.handler`` names."""
    mod, _, fn = h.handler.partition(":")
    return getattr(importlib.import_module(f"{__package__}.{mod}"), fn)


def start(modes: tuple[str, ...], registry, hook_type, done: set[str]) -> list[Hook]:
    """At the start of ``modes``: check exactly their hooks and reads (a mismatch stops the
    process with one line, nothing of theirs registered), then register each of their hooks
    whose target is not in ``done`` (adding it there); returns the hooks registered now.
    ``ValueError`` naming an unknown mode."""
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"flatcake mode {bad[0]!r} is unknown; expected one of {MODES}")
    check_or_exit(hooks_of(modes), members_of(modes), tuple(modes))
    new = [h for h in hooks_of(modes) if h.target not in done]
    for h in new:
        registry.register(h.target, handler(h), getattr(hook_type, h.kind.upper()))
        done.add(h.target)
    return new
