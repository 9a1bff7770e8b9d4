"""A tiny random-weight hybrid checkpoint with a byte-level tokenizer, for end-to-end eval tests.

Every text (HumanEval prompts, GSM8K questions) tokenizes losslessly: 256 byte tokens, then <|bos|> (added
in front of every encoding) and <|eos|>. The model mixes Mamba2, sliding-window and full attention so the
evaluations exercise every cache kind; its scores are ~0 by construction.
"""

from __future__ import annotations

import json
from pathlib import Path

from hybridkv import HybridConfig
from hybridkv.models.config import MLP, Attention, Layer, Mamba2
from hybridkv.models.hybrid import build_model, save_model

BOS_ID, EOS_ID = 256, 257


def tiny_config(*, max_position_embeddings: int = 8192) -> HybridConfig:
    mlp = MLP(intermediate_size=64)
    layers = (
        Layer(mixer=Mamba2(num_heads=2, head_dim=16, state_size=8, chunk_size=32), ffn=mlp),
        Layer(mixer=Attention(num_heads=2, num_kv_heads=1, head_dim=16, sliding_window=8), ffn=mlp),
        Layer(mixer=Attention(num_heads=2, num_kv_heads=1, head_dim=16), ffn=mlp),
    )
    return HybridConfig(vocab_size=260, hidden_size=32, layers=layers, max_position_embeddings=max_position_embeddings,
                        dtype="float32", bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,), architecture="TinyEval")


def build_tokenizer_json() -> str:
    """Byte-level BPE without merges (one token per byte), BOS added by the post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(["<|bos|>", "<|eos|>"])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", BOS_ID)])
    assert tok.token_to_id("<|bos|>") == BOS_ID and tok.token_to_id("<|eos|>") == EOS_ID
    return tok.to_str()


def _byte_of(ch: str) -> int:
    """GPT-2's byte -> printable-char map, inverted (so token id == byte value)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars[ch]


def build_tiny_checkpoint(directory: str | Path, *, seed: int = 0) -> Path:
    """Save the tiny model (``save_model``) plus tokenizer.json / tokenizer_config.json into ``directory``."""
    directory = Path(directory)
    save_model(build_model(tiny_config(), seed=seed), directory)
    (directory / "tokenizer.json").write_text(build_tokenizer_json())
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|bos|>", "eos_token": "<|eos|>"}))
    return directory
