"""A custom layer mix as data: Mamba2, sliding-window, chunked-local and full attention layers in one
decoder. The KV-cache plan follows from the same description (each kind keeps what it needs), then the
model (random weights) generates through the engine.

    python examples/custom_layer_mix.py [--tiny]
"""

from __future__ import annotations

import argparse

from hybridkv import LLM, HybridConfig, SamplingParams, plan
from hybridkv.models import MLP, Attention, Layer, Mamba2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a few-layer model that runs anywhere in seconds")
    args = ap.parse_args()
    width, heads = (64, 4) if args.tiny else (1024, 16)
    attn = dict(num_heads=heads, num_kv_heads=heads // 4, head_dim=width // heads)
    mlp = MLP(intermediate_size=2 * width)
    config = HybridConfig(vocab_size=1024, hidden_size=width, max_position_embeddings=8192, layers=(
        Layer(mixer=Mamba2(num_heads=heads, head_dim=width // heads, state_size=16), ffn=mlp),
        Layer(mixer=Attention(sliding_window=512, **attn), ffn=mlp),
        Layer(mixer=Attention(attention_chunk_size=1024, **attn), ffn=mlp),
        Layer(mixer=Attention(rope=None, **attn), ffn=mlp),                 # global attention without RoPE
    ))

    # What a 1 GiB budget buys at 8k tokens per request, before any weight exists.
    print(plan(config, max_model_len=8192, kv_memory="1GiB").summary())

    llm = LLM(config, device="cpu" if args.tiny else "auto", kv_cache_memory="256MiB", max_model_len=8192)
    prompts = [[1, 2, 3, 4, 5], list(range(10, 200))]                   # token ids: a random model has no tokenizer
    for out in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False):
        print(f"{len(out.prompt_token_ids)} prompt tokens -> {list(out.outputs[0].token_ids)}")


if __name__ == "__main__":
    main()
