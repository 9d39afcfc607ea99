"""Commands and the demo's helpers: what a person runs, never imported by the data path.

  cli.py            ``flatcake`` (the console script): dispatches to the commands below
  demo.py           ``flatcake demo``; demo_report.py prints and plots its table
  bench_restore.py  ``flatcake bench-restore``
  inspect_store.py  ``flatcake inspect``
  patch.py          ``flatcake patch``: checks the installed SGLang and its hook targets
  server.py         one SGLang server process on CPU; peers.py the compared backends
  processes.py      waiting on and stopping the helper processes; interrupts.py Ctrl-C
  replay_client.py  replays a trace against a server over HTTP
  tiny_model.py, trace_slice.py  build the demo's model and trace slice
"""
