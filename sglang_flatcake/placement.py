"""FC-GVA: decide a block's home once, when it is written.

``place`` is a pure function of the write-time signals and the placement settings
(``PlacementConfig``: ``cfg.placement``, or the whole ``FlatCakeConfig``, which is one).  Rules
are checked in the order of ``Rule`` (the first that fires wins); the decision
records which rule fired so that metrics can count them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .address import Medium
from .config_groups import PlacementConfig


class Rule(str, Enum):
    MEMORY_FULL = "memory_full"          # memory cannot take the write -> SSD
    SHARED_PREFIX = "shared_prefix"      # refcount >= shared_refcount -> memory
    FIRST_TURN = "first_turn"            # turn 0 of a session -> SSD
    AGENT_CONTEXT = "agent_context"      # existing context > agent threshold -> SSD
    LONG_REPLY = "long_reply"            # previous reply > short threshold -> SSD
    SHORT_CHAT = "short_chat"            # later turn after a short reply -> memory


@dataclass(frozen=True)
class WriteSignals:
    """What SGLang knows when a block is written.

    ``turn`` counts from 0 (0 is the first turn of a session); ``context_tokens``
    is the context that exists before this write; ``prev_reply_tokens`` is the
    length of the previous reply (0 on a first turn).
    """

    refcount: int = 1
    turn: int = 0
    context_tokens: int = 0
    prev_reply_tokens: int = 0


@dataclass(frozen=True)
class Placement:
    medium: Medium
    rule: Rule


def place(signals: WriteSignals, memory_free: bool, config: PlacementConfig) -> Placement:
    """Return where a block written with ``signals`` lives.

    ``memory_free`` is whether the host arena can take this write now.  Memory
    full is checked first: a block that cannot go to memory goes to SSD
    whatever the other signals say.
    """
    if not memory_free:
        return Placement(Medium.SSD, Rule.MEMORY_FULL)
    if signals.refcount >= config.shared_refcount:
        return Placement(Medium.MEMORY, Rule.SHARED_PREFIX)
    if signals.turn <= 0:
        return Placement(Medium.SSD, Rule.FIRST_TURN)
    if signals.context_tokens > config.agent_context_tokens:
        return Placement(Medium.SSD, Rule.AGENT_CONTEXT)
    if signals.prev_reply_tokens > config.short_reply_tokens:
        return Placement(Medium.SSD, Rule.LONG_REPLY)
    return Placement(Medium.MEMORY, Rule.SHORT_CHAT)
