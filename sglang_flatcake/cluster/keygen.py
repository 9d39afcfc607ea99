"""Make a node's key file: ``python -m sglang_flatcake.cluster.keygen --node N --out FILE``.

Writes 32 random bytes (hex) to ``FILE`` (created, mode 600; an existing file is refused)
and prints the node's roster line (``N <ed25519 public hex> <x25519 public hex>``), which
the operator appends to the roster file every node reads (docs/cluster.md).
"""

from __future__ import annotations

import argparse
import os
import sys

from .identity import MAX_NODE, roster_line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--node", type=int, required=True, help=f"the node's id (0..{MAX_NODE})")
    p.add_argument("--out", required=True, help="the node's key file to create (mode 600)")
    a = p.parse_args(argv)
    if not 0 <= a.node <= MAX_NODE:
        p.error(f"--node {a.node}: expected 0..{MAX_NODE}")
    seed = os.urandom(32)
    try:
        fd = os.open(a.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        p.error(f"--out {a.out!r}: {e.strerror} (an existing key file is never overwritten)")
    with open(fd, "w") as f:
        f.write(seed.hex() + "\n")
    print(roster_line(a.node, seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
