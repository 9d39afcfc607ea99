"""The ``flatcake`` command: demo, replay, tune, bench-restore, inspect, patch."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..errors import FlatCakeError
from . import interrupts
from .demo_flags import split_server_flags


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit code.  Ctrl-C ends any command with one line and 130; a
    reader that stops early (``flatcake inspect DIR | head``) ends it quietly with 141."""
    cmd, err = "flatcake", None
    try:
        args = _parse(argv)
        cmd = f"flatcake {args.cmd}"
        with interrupts.line_ends_tracked() as err, interrupts.caught():
            rc = _dispatch(args)
            interrupts.check()           # a Ctrl-C a finalizer swallowed still ends in 130
        sys.stdout.flush()                # a closed pipe shows here, not at interpreter exit
        return rc
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())   # so the flush at exit writes nowhere
        return 141
    except KeyboardInterrupt:
        # every server and helper process a command starts is stopped in a ``finally``
        # on the way up here, so by now none is left running
        # on a line of its own, even when the Ctrl-C landed between a print's text and newline
        print(("" if err is None or err.at_line_start else "\n") + f"{cmd}: interrupted"
              + ("; the servers it started are stopped" if cmd == "flatcake demo" else ""),
              file=sys.stderr)
        return 130


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="flatcake", description="FlatCake, a flat KV-cache store "
                                "for SGLang: its demo, replay, tuning, benchmark and tools.")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    from . import bench_restore, demo
    from ..replay import run as replay_run
    from ..replay import tune

    d = sub.add_parser("demo", help="a real SGLang server with flatcake, replaying a bundled agent "
                                    "trace slice with its own client (CPU, no download)")
    demo.add_arguments(d)
    r = sub.add_parser("replay", help="FlatCake against tiered caches on a real trace, side by "
                                      "side (real stores, a simulated serving clock)")
    replay_run.add_arguments(r)
    t = sub.add_parser("tune", help="the write-time thresholds (--flatcake-* flags) from your own "
                                    "trace, chosen on part of it and checked on the rest")
    tune.add_arguments(t)
    b = sub.add_parser("bench-restore", help="cold restore of one long session vs the raw disk "
                                             "limit and SGLang's HiCacheFile")
    bench_restore.add_arguments(b)
    i = sub.add_parser("inspect", help="what a store holds (sessions, segments, bytes on SSD, "
                                       "watermark state); --verify its checksums")
    i.add_argument("dir", help="a store directory, a --flatcake-store-dir root (every store "
                               "under it), or a region (block device or pre-sized file)")
    i.add_argument("--verify", action="store_true",
                   help="re-check every checksum; exit 1 on damage")
    i.add_argument("--json", action="store_true", help="print JSON instead of a table")
    i.add_argument("--ssd-bytes", help="SSD capacity for the watermark report (e.g. 512GiB)")
    from . import verify
    ve = sub.add_parser("verify", help="does a running server restore from flatcake? (a fresh "
                                       "cache salt; --allow-flush to check a restore)")
    verify.add_arguments(ve)
    pa = sub.add_parser("patch", help="check the installed SGLang (0.5.23) and apply or verify patches/")
    pa.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")

    argv = list(sys.argv[1:] if argv is None else argv)
    server_flags: list[str] = []
    if "demo" in argv:
        argv, server_flags = split_server_flags(argv)
    args = p.parse_args(argv)
    if server_flags:
        args.server_args = list(args.server_args) + server_flags
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return args


def _dispatch(args: argparse.Namespace) -> int:
    from . import bench_restore, demo
    from ..replay import run as replay_run
    from ..replay import tune
    try:
        if args.cmd == "demo":
            return demo.run(args)
        if args.cmd == "replay":
            return replay_run.run(args)
        if args.cmd == "tune":
            return tune.run(args)
        if args.cmd == "bench-restore":
            bench_restore.run(args)
            return 0
        if args.cmd == "inspect":
            from . import inspect_store
            from ..config import parse_bytes
            ssd = parse_bytes(args.ssd_bytes, "--ssd-bytes") if args.ssd_bytes else None
            return inspect_store.run(args.dir, args.verify, args.json, ssd)
        if args.cmd == "verify":
            from . import verify
            return verify.run(args)
        if args.cmd == "patch":
            from . import patch
            return patch.run(args.dry_run)
    except FlatCakeError as e:
        print(f"flatcake: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
