"""``flatcake replay``: FlatCake against tiered KV caches on real request traces.

Every system gets the same memory and SSD budgets and does real reads and
writes on the same disk (O_DIRECT through ``io.posix.PosixEngine``; sglang-file
through SGLang's own ``HiCacheFile``).  What is stored where, what a request
finds, what is read, how many commands and bytes: all real.  *When* things
happen is virtual time from deterministic cost models (``sizes``): a disk
shared by the jobs in flight and a GPU that prefills N tokens per second, at
the model's full-size bytes.  Real reads run on threads while their jobs are
in flight in virtual time, so restores that overlap there overlap on the disk.
Same trace, seed and models: same rows.

Structure:

  traces.py     requests, conversations, arrival schedules
  loaders.py    Mooncake / WEKA loaders (load_trace)
  sizes.py      model, GPU and disk presets; ``--scale`` to a real KVLayout
  clock.py      the event loop and the processor-sharing disk
  systems/      base.py (the interface), flatcake.py (the real store, and its
                single-queue ablation),
                tiered.py (tiered-lru, mooncake-fifo, memory-only),
                ssd_tiers.py (slot file, Mooncake buckets), sglang_file.py
  policy.py     scheduler policies: FCFS, FlatCake's two queues (``sched/queues.py``)
  replayer.py   one replay: arrivals, restores, prefills, writes, refcounts
  metrics.py    the paper's metrics per system and rate
  report.py     table, JSON, PNG
  run.py        ``add_arguments`` / ``run``: the command
"""
