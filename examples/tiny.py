"""A tiny random-weight checkpoint for running the examples anywhere (``--tiny``): a hybrid of Mamba2,
sliding-window, chunked-local and full attention layers, with a byte-level tokenizer (every text encodes,
one token per byte) and a chat template. Its outputs are random bytes: it shows how things run, not what a
real model says."""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hybridkv import LLM, HybridConfig
from hybridkv.models import MLP, Attention, Layer, Mamba2
from hybridkv.models.hybrid import build_model, save_model

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tiny_config() -> HybridConfig:
    attn = dict(num_heads=2, num_kv_heads=1, head_dim=16)
    mlp = MLP(intermediate_size=64)
    return HybridConfig(vocab_size=260, hidden_size=32, max_position_embeddings=4096, dtype="float32",
                        bos_token_id=256, eos_token_ids=(257,), layers=(
                            Layer(mixer=Mamba2(num_heads=2, head_dim=16, state_size=8, chunk_size=32), ffn=mlp),
                            Layer(mixer=Attention(sliding_window=32, **attn), ffn=mlp),
                            Layer(mixer=Attention(attention_chunk_size=64, **attn), ffn=mlp),
                            Layer(mixer=Attention(**attn), ffn=mlp)))


def tiny_checkpoint(directory: str | Path) -> Path:
    """Write the tiny model, its tokenizer and chat template into ``directory``; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    directory = Path(directory)
    save_model(build_model(tiny_config(), seed=0), directory)
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(byte_chars))}, merges=[]))
    tok.add_special_tokens(["<|bos|>", "<|eos|>"])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 256)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": CHAT_TEMPLATE}))
    return directory


def checkpoint_parser(doc: str, checkpoint_help: str) -> argparse.ArgumentParser:
    """An example's command line: a checkpoint directory, or ``--tiny``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("checkpoint", nargs="?", help=checkpoint_help)
    ap.add_argument("--tiny", action="store_true", help="a tiny random checkpoint with a byte tokenizer instead")
    return ap


@contextlib.contextmanager
def open_llm(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Iterator[LLM]:
    """The ``LLM`` of ``args.checkpoint``, or of the tiny checkpoint written to a temporary directory (``--tiny``:
    on the CPU, 64 MiB of KV cache)."""
    if (args.checkpoint is None) == (not args.tiny):
        ap.error("give a checkpoint directory or --tiny")
    with tempfile.TemporaryDirectory() as tmp:
        yield LLM(tiny_checkpoint(tmp), device="cpu", kv_cache_memory="64MiB") if args.tiny else LLM(args.checkpoint)
