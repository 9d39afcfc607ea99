#!/usr/bin/env bash
# The replay benchmark: the bundled WEKA Claude Code slice, every system, rates 0.1..1.0,
# default budgets (memory 10% of the working set, staging half of it, SSD 2x), DeepSeek-V4-Flash
# sizes, the local-disk model, seed 0.  Prints its configuration and progress on stderr and the
# table on stdout; writes replay_default.json and replay_default.png in the current folder.
# Extra arguments are passed on, e.g.
#   benchmarks/replay_default.sh --trace /work/shared/traces/mooncake_conversation_trace.jsonl.xz
# sglang-file runs only where sglang imports (PYTHON=/work/venv-sgl/bin/python).
set -euo pipefail
PY=${PYTHON:-python}
exec "$PY" -m sglang_flatcake.replay.run --json replay_default.json --plot replay_default.png "$@"
