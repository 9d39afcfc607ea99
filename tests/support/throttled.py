"""What the never-waits server tests of both modes share: a store throttled so that restoring a
40-page history takes ~12.5 s, and the steps that store three prompts and start the disk probe."""

from __future__ import annotations

import time

from sglang_flatcake.commands.processes import wait_until
from sglang_flatcake.commands.server_calls import flush, generate, prompt_ids, stored_blocks

PAGE = 16
PAGES = 40
DELAY = 40.0                 # s per MiB: 40 pages of 8 KiB restore in ~12.5 s
RESTORE_S = DELAY * PAGES * 8 / 1024
ENV = {"FLATCAKE_TEST_SSD_DELAY_S_PER_MIB": str(DELAY)}


def timed(s, ids):
    """(seconds, response) of one request of one output token."""
    t0 = time.monotonic()
    out = generate(s, ids, 1)
    return time.monotonic() - t0, out


def store_then_probe(s, store, a, b, c, warm_seed: int) -> float:
    """Measure the prefill on a warm-up prompt, time ``a`` uncached, store ``a``, ``b`` and the
    short ``c``, flush the device, then ask ``c`` again: restored with no price yet, it starts
    the disk probe.  Returns ``a``'s uncached seconds."""
    generate(s, prompt_ids(600, warm_seed), 1)
    uncached, _ = timed(s, a)
    generate(s, b, 1)
    generate(s, c, 1)
    wait_until(lambda: stored_blocks(store) >= 2 * PAGES + 3 - 6, 120, "a, b, c stored")
    flush(s)
    generate(s, c, 1)
    return uncached


def assert_not_waited(took: float, took_b: float, uncached: float) -> None:
    """Both histories came back far sooner than their throttled restore, near the uncached."""
    assert took < 0.25 * RESTORE_S and took < 3 * uncached + 1.0, (took, uncached)
    assert took_b < 0.25 * RESTORE_S and took_b < 3 * uncached + 1.0, (took_b, uncached)
