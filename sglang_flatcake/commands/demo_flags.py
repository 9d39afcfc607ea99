"""Which of ``flatcake demo``'s arguments go to the server it starts: the ``--flatcake-*``
flags, so that SGLang itself validates them."""

from __future__ import annotations


def split_server_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """``flatcake demo --flatcake-x V``: the ``--flatcake-*`` flags (with their values) go to
    the server, so SGLang itself validates them."""
    keep, flags, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            keep += argv[i:]
            break
        if a.startswith("--flatcake-"):
            flags.append(a)
            if "=" not in a and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                flags.append(argv[i + 1])
                i += 1
        else:
            keep.append(a)
        i += 1
    return keep, flags
