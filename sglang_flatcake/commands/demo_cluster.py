"""``flatcake demo --nodes 2``: a session stored on node 0 is restored on node 1, then node
0 is killed.

Starts redis-server (the page directory), a server with no cache at all (the reference) and
two CPU servers with flatcake, each with its own store, ``--flatcake-node-id 0|1`` and the
same ``--flatcake-cluster-directory`` and ``--flatcake-cluster-secret-file`` (a fresh random
secret, mode 600, in the work folder), each with its own node key file and the roster of
both.  Session 1's first two turns and session 2's first turn go to node 0; session 1's third turn goes to node 1, which restores the history from
node 0 through the Transfer Engine (``remote_storage_tokens``: node 1's storage hits on it;
``same_logprobs``: its answer against the reference's).  Then node 0 is SIGKILLed, and node 1
gets session 2's next turn at once (its owner is dead but may still be listed: a miss within
``--flatcake-remote-timeout-s``) and, after a flush, session 1's fourth turn;
``after_owner_killed_ok``: both answered, no error, same logprobs as the reference, each
restore (its log line) done within the timeout plus 0.5 s, and each answer within the timeout
plus its own prefill (the reference's time for it) plus 2 s of CPU noise.  The nodes run
with ``--flatcake-recompute-when-faster=false``: on the tiny CPU model recomputing a 600-token
history (under 0.1 s) beats any restore, so the decision would rightly skip the restores this
demo exists to show.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
from pathlib import Path

from . import interrupts
from .server_calls import DemoFailure
from .demo_cluster_steps import PAGE, TIMEOUT_S, reference, scenario

def _start_all(servers) -> None:
    """Start ``servers`` side by side, one thread each.  A Ctrl-C reaches every start (each
    one's wait sees it through ``interrupts`` and stops its own server); every thread has
    ended before the ``KeyboardInterrupt`` goes on, so none starts a server after it.  The
    main thread waits on events, not ``Thread.join``: in Python 3.11 a join that a Ctrl-C
    interrupts marks the thread as ended while it still runs, and a second join returns at
    once."""
    errors = []
    ended = [threading.Event() for _ in servers]

    def start(s, done):
        try:
            s.start()
        except (RuntimeError, TimeoutError):
            errors.append(f"a server did not start: {s.failure_line()} (log: {s.log_path})")
        except KeyboardInterrupt:
            pass                         # the main thread has it too; s.start stopped s
        finally:
            done.set()
    threads = [threading.Thread(target=start, args=(s, e)) for s, e in zip(servers, ended)]
    try:
        with interrupts.held():          # all started (none half-way) before a Ctrl-C
            for t in threads:
                t.start()
        for e in ended:
            e.wait()
    except KeyboardInterrupt:
        for t, e in zip(threads, ended):
            if t.ident is not None:      # started (held() sees to that where SIGINT is ours)
                e.wait()
        raise
    if errors:
        raise DemoFailure(errors[0])


def run_nodes(args) -> int:
    """The scenario (module docstring); prints a table and writes ``--json``."""
    if args.nodes != 2:
        raise DemoFailure(f"--nodes {args.nodes}: the cluster demo runs 2 nodes (or 1: the "
                          f"single-node demo)")
    from .redis_server import RedisServer
    from .server import ServerProcess, cpu_server_args
    from .tiny_model import build_tiny_llama
    work = Path(tempfile.mkdtemp(prefix="flatcake-demo-nodes-"))
    print(f"[demo] building a tiny random Llama; work folder {work}", file=sys.stderr)
    model = str(build_tiny_llama(work / "tiny-llama"))
    directory = RedisServer(work / "redis")          # started in the try below
    secret = work / "cluster.secret"
    with open(os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(os.urandom(32).hex())
    from ..cluster.identity import roster_line
    seeds = [os.urandom(32) for _ in range(2)]          # each node's own key (cluster.keygen)
    for i, seed in enumerate(seeds):
        with open(os.open(work / f"node{i}.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600),
                  "w") as f:
            f.write(seed.hex())
    with open(os.open(work / "roster", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write("".join(roster_line(i, seed) + "\n" for i, seed in enumerate(seeds)))
    ref = ServerProcess(cpu_server_args(model, "", PAGE, backend="none",
                                        extra=["--disable-radix-cache"]),
                        log_path=str(work / "reference.log"))
    nodes = [ServerProcess(cpu_server_args(model, str(work / f"store{i}"), PAGE, extra=[
        "--enable-metrics", "--flatcake-node-id", str(i), "--flatcake-cluster-directory",
        directory.url, "--flatcake-cluster-secret-file", str(secret),
        "--flatcake-cluster-node-key-file", str(work / f"node{i}.key"),
        "--flatcake-cluster-roster-file", str(work / "roster"),
        "--flatcake-remote-timeout-s", str(TIMEOUT_S),
        "--flatcake-recompute-when-faster=false"]),       # the demo is about restores
        log_path=str(work / f"node{i}.log")) for i in range(2)]
    try:
        try:
            directory.start()
        except (RuntimeError, TimeoutError) as e:
            raise DemoFailure(f"the directory did not start: {e}") from None
        print("[demo] the reference server (no cache) answers every turn first ...",
              file=sys.stderr)
        _start_all([ref])                     # one at a time: SGLang checks free host memory
        turns = reference(ref)
        ref.stop()
        print("[demo] starting nodes 0 and 1 ...", file=sys.stderr)
        _start_all(nodes)
        doc = scenario(turns, nodes, directory.url)
    finally:
        for p in (ref, *nodes, directory):
            p.stop()
    doc.update(page_tokens=PAGE, remote_timeout_s=TIMEOUT_S, work=str(work))
    _print(doc)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"written to {args.json}")
    return 0


def _print(doc) -> None:
    print(f"flatcake demo --nodes 2: tiny CPU model, {doc['page_tokens']}-token pages, remote "
          f"timeout {doc['remote_timeout_s']} s")
    print(f"{'step':<26}{'node':>5}{'prompt':>8}{'storage':>9}{'same lp':>9}{'s':>8}{'ref s':>8}"
          f"{'restore s':>11}")
    for r in doc["steps"]:
        if "node" not in r:
            print(f"{r['step']:<26}")
            continue
        print(f"{r['step']:<26}{r['node']:>5}{r['prompt_tokens']:>8}{r['storage_tokens']:>9}"
              f"{'yes' if r['same_logprobs'] else 'NO':>9}{r['seconds']:>8.2f}"
              f"{r['reference_seconds']:>8.2f}"
              f"{'-' if r['restore_s'] is None else format(r['restore_s'], '.3f'):>11}")
    print(f"handed-over turn: {doc['remote_storage_tokens']} of {doc['prompt_tokens']} prompt "
          f"tokens from node 0's store; same logprobs: {doc['same_logprobs']}; after node 0 "
          f"was killed every request answered in bound: {doc['after_owner_killed_ok']}")
