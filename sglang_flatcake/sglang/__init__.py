"""The SGLang adapter: the only part of the package that imports sglang.

``plugin.py`` is the ``sglang.srt.plugins`` entry point; ``hicache/`` is HiCache mode (the
storage backend and its scheduling hooks); ``linker/`` is linker mode (``FlatCakeLinker``);
what both modes use sits here once (``rank_store``, ``hooks``/``hook_table``, ``metrics``,
``counters``, ``write_once``, ``cpu``).
"""
