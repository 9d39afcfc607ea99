"""FlatCake: a flat KV-cache store for SGLang HiCache.

Blocks get their home (host memory or SSD) once, at write time; a session's SSD
blocks live in one contiguous, layer-major file and never move.  The store in
this package knows nothing about SGLang; ``sglang_flatcake.sglang`` adapts it.
"""

__version__ = "0.1.0"
FORMAT_VERSION = 2                # 2: key fingerprints fold in all 32 bytes of a hex key
