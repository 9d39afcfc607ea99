"""What the real-server tests share (``tests/sglang/test_e2e_server.py``,
``tests/cluster/test_cluster_e2e.py``); the tiny model is the ``model`` fixture in
``tests/conftest.py``."""

PAGE = 16      # the servers' page size in tokens

# ``python -c HELP_AND_BAD_FLAG ARGS...``: SGLang's ``--help`` with the plugin loaded, a
# ``=====`` line, then SGLang parsing ARGS (a bad ``--flatcake-*`` value must stop it)
HELP_AND_BAD_FLAG = r"""
import sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
try:
    prepare_server_args(["--help"])
except SystemExit:
    pass
print("=====")
sys.stdout.flush()
prepare_server_args(sys.argv[1:])
"""
