"""Writes at low CPU priority: a thread that writes KV to the store lowers its own nice.

Called by the thread that writes (the linker's offload worker; in HiCache mode, SGLang's
storage-backup thread, the one that calls ``batch_set_v1``): on a CPU the forward wants every
core, so the writes take only what it leaves, and a storing pass does not slow the pass it
stores.  Linux applies a nice per thread (``setpriority`` on the thread's id).  Never the
scheduler's own (main) thread; never raises (a refusal is logged once, the writes go on).
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("sglang_flatcake")


class _Done(threading.local):
    """Per thread: the nice this thread was given (-1 after a refusal), None before."""
    nice: int | None = None


_local = _Done()


def lower_this_thread(nice: int) -> bool:
    """Give the calling thread at least ``nice`` (once per thread); True when it now runs at
    ``nice`` or lower priority.  False for ``nice <= 0``, the main thread, or a platform or
    process that refuses."""
    if nice <= 0 or threading.current_thread() is threading.main_thread():
        return False
    done = _local.nice
    if done is not None:
        return done >= nice
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        if now < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        _local.nice = max(now, nice)
    except (OSError, AttributeError) as e:
        _local.nice = -1
        log.warning("flatcake: could not lower the KV writer thread's priority to nice %d (%s); "
                    "writes run at the forward's priority", nice, e)
        return False
    return True
