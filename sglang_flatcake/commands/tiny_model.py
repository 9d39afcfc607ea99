"""A tiny random Llama with an offline-trained tokenizer, for CPU servers and tests.

No download: the context is 16384 tokens (the bundled agent slice's longest
request is 12288 + 64), the config is written by hand, the weights are random (seeded),
and a byte-level BPE tokenizer is trained on a few built-in sentences.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "FlatCake stores each session's KV cache contiguously on SSD, layer by layer.",
    "def restore(session, layer): return read(session.file, session.offsets[layer])",
    "Agents carry long histories: tool calls, file contents, diffs and test logs.",
    "Hello! How can I help you today? Please explain the error in this stack trace.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ {}[]()<>:;,.!?-_=+*/\\|'\"",
]


def build_tiny_llama(path: str | Path, *, layers: int = 2, hidden: int = 64, heads: int = 4,
                     kv_heads: int = 2, vocab: int = 512, max_positions: int = 16384,
                     seed: int = 0) -> Path:
    """Write a tiny Llama (config, safetensors weights, tokenizer) to ``path``; idempotent."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
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
    (path / "flatcake_tiny.json").write_text(json.dumps({"seed": seed, "built_by": "sglang_flatcake"}))
    return path


if __name__ == "__main__":
    import sys
    print(build_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"))
