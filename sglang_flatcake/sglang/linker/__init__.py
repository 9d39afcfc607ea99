"""Linker mode (``--enable-unified-cache-external-linker``): ``FlatCakeLinker`` (``linker``)
is SGLang's direct external linker, no host tier; ``lookup`` prices restore or recompute,
``load`` restores layer by layer, ``offload`` writes, ``admission`` orders the waiting queue.

SGLang imports ``sglang_flatcake.sglang.linker`` and takes ``FlatCakeLinker`` from it; the class
is loaded on first use, so importing the package alone pulls in nothing heavy."""


def __getattr__(name):
    if name == "FlatCakeLinker":
        from .linker import FlatCakeLinker
        return FlatCakeLinker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
