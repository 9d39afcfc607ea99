"""The SGLang adapter: the only part of the package that imports sglang.

``plugin.py`` is the ``sglang.srt.plugins`` entry point; ``backend.py`` is the
HiCache storage backend; ``cpu.py`` makes HiCache run on a CPU server;
``signals.py`` carries write-time signals from the radix tree to placement.
"""
