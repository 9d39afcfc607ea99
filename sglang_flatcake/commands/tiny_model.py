"""A tiny random Llama with an offline-trained tokenizer, for CPU servers and tests.

No download: the config is written by hand, the weights are random (seeded), and a
byte-level BPE tokenizer is trained (quietly) on a few built-in sentences.

``build_tiny_llama(path)`` writes one into ``path``.  ``cached_tiny_llama(...)`` keeps one
per set of parameters in a private cache directory (``$FLATCAKE_DEMO_CACHE``, else
``$XDG_CACHE_HOME/sglang-flatcake-demo`` or ``~/.cache/sglang-flatcake-demo``), keyed by the
parameters, ``TINY_VERSION`` and the transformers version: built only when missing or
different, into a temporary directory renamed into place, so two concurrent builds
leave one complete model and a reader never sees half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "FlatCake stores each session's KV cache contiguously on SSD, layer by layer.",
    "def restore(session, layer): return read(session.file, session.offsets[layer])",
    "Agents carry long histories: tool calls, file contents, diffs and test logs.",
    "Hello! How can I help you today? Please explain the error in this stack trace.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ {}[]()<>:;,.!?-_=+*/\\|'\"",
]
TINY_VERSION = 1                 # bump when what build_tiny_llama writes changes
MARKER = "flatcake_tiny.json"
PARTS = ("config.json", "tokenizer.json", "model.safetensors", MARKER)
DEFAULTS = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 512,
            "max_positions": 16384, "seed": 0}


def build_tiny_llama(path: str | Path, *, layers: int = 2, hidden: int = 64, heads: int = 4,
                     kv_heads: int = 2, vocab: int = 512, max_positions: int = 16384,
                     seed: int = 0) -> Path:
    """Write a tiny Llama (config, safetensors weights, tokenizer) to ``path``; a ``path``
    that already holds one is returned as it is.  Prints nothing."""
    path = Path(path)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden,
                      intermediate_size=hidden * 2, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_positions, bos_token_id=0, eos_token_id=1,
                      torch_dtype="float32", tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    (path / MARKER).write_text(json.dumps({"seed": seed, "built_by": "sglang_flatcake"}))
    return path


def cache_dir() -> Path:
    """Where ``cached_tiny_llama`` keeps its models (see the module docstring)."""
    if os.environ.get("FLATCAKE_DEMO_CACHE"):
        return Path(os.environ["FLATCAKE_DEMO_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sglang-flatcake-demo"


def tiny_key(**params) -> dict:
    """What a cached model is keyed by: its parameters, ``TINY_VERSION``, transformers' version."""
    from importlib.metadata import version
    unknown = set(params) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown tiny-model parameters {sorted(unknown)}")
    return {**DEFAULTS, **params, "tiny_version": TINY_VERSION,
            "transformers": version("transformers")}


def _complete(path: Path, key: dict) -> bool:
    try:
        return (all((path / p).is_file() for p in PARTS)
                and json.loads((path / MARKER).read_text()).get("key") == key)
    except (OSError, ValueError):
        return False


def cached_tiny_llama(root: str | Path | None = None, announce=None,
                      **params) -> tuple[Path, bool]:
    """``(path, built)``: the cached tiny Llama for ``params`` (``build_tiny_llama``'s keyword
    arguments), built now (``built`` True; ``announce(path)`` is called first) only when
    missing or made with other parameters or versions.  ``root`` defaults to
    ``cache_dir()``, made private (0700)."""
    from ..private_fs import private_dir
    key = tiny_key(**params)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    base = private_dir(root or cache_dir())
    final = base / f"tiny-llama-{digest}"
    if _complete(final, key):
        return final, False
    if announce is not None:
        announce(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{digest}-", dir=base))
    try:
        _build_in_child(tmp, {k: key[k] for k in DEFAULTS})
        (tmp / MARKER).write_text(json.dumps({"built_by": "sglang_flatcake", "key": key}))
        if final.exists() and not _complete(final, key):     # half-made or foreign: set aside
            stale = Path(tempfile.mkdtemp(prefix=f".stale-{digest}-", dir=base))
            try:
                os.rename(final, stale / "old")
            except FileNotFoundError:
                pass                                         # another builder moved it first
            shutil.rmtree(stale)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _complete(final, key):                    # not a concurrent build winning
                raise
    finally:
        if tmp.exists():                                     # the build failed or lost the race
            shutil.rmtree(tmp)
    return final, True


def _build_in_child(path: Path, params: dict) -> None:
    """``build_tiny_llama(path, **params)`` in a child Python, so the caller (``flatcake demo``)
    never imports torch: a Ctrl-C then ends it at once instead of after torch's teardown.  A
    failed build raises ``RuntimeError`` with the child's last line."""
    code = ("import json, sys; from sglang_flatcake.commands.tiny_model import build_tiny_llama; "
            "build_tiny_llama(sys.argv[1], **json.loads(sys.argv[2]))")
    here = str(Path(__file__).resolve().parents[2])       # where this sglang_flatcake lives
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    r = subprocess.run([sys.executable, "-c", code, str(path), json.dumps(params)],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        from . import interrupts
        interrupts.check()       # a Ctrl-C that reached the child first is still a Ctrl-C
        lines = (r.stderr or r.stdout).strip().splitlines() or ["no output"]
        raise RuntimeError(f"building the tiny model failed (exit {r.returncode}): {lines[-1]}")


if __name__ == "__main__":
    print(build_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"))
