"""Which (system, policy) runs ``flatcake replay`` makes, in order (shared with ``tune``)."""

from __future__ import annotations

from .policy import POLICIES
from .systems import SYSTEMS
from .systems.flatcake import FlatCake


def policy_name(choice: str, system: str, over: dict | None = None) -> str:
    """The policy ``system`` runs under for ``--policy choice`` (``auto``: its own, or
    head-only for a flatcake store with ``single_queue`` among the flags ``over``)."""
    if choice != "auto":
        return choice
    if over and over.get("single_queue") and issubclass(SYSTEMS[system], FlatCake):
        return "head-only"
    return SYSTEMS[system].policy


def plan_runs(systems: list[str], choice: str, compare: bool,
              over: dict | None = None) -> list[tuple[str, str]]:
    """(system, policy) pairs, in order.  With ``--policy auto`` and ``compare``, every
    flatcake store also runs under each policy it does not run under already (a system
    ``same_as`` another counts as that one under its own policy)."""
    runs = [(s, policy_name(choice, s, over)) for s in systems]
    if choice != "auto" or not compare:
        return runs
    out = []
    for s, pol in runs:
        out.append((s, pol))
        if not issubclass(SYSTEMS[s], FlatCake) or SYSTEMS[s].same_as:
            continue
        have = {p for t, p in runs if t == s or SYSTEMS[t].same_as == s}
        out += [(s, p) for p in POLICIES if p not in have]
    return out
