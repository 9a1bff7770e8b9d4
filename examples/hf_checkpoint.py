"""Load a Hugging Face checkpoint directory (config.json + safetensors, hub weight names) and generate; the
greedy tokens are transformers' own.

    python examples/hf_checkpoint.py PATH/TO/CHECKPOINT [--prompt "Hello"]
    python examples/hf_checkpoint.py --tiny      # a tiny random Gemma-3 saved by transformers, then loaded

Any supported architecture loads this way (Llama-4, Mamba2, Mistral, Gemma-2/3, Bamba, Jamba, Zamba2,
NemotronH, Falcon-H1, GraniteMoeHybrid); ``hybridkv plan PATH`` shows its KV-cache plan first.
"""

from __future__ import annotations

import argparse
import tempfile

from hybridkv import LLM, SamplingParams


def tiny_hf_checkpoint(directory: str) -> str:
    """A tiny Gemma-3 (sliding-window and global layers) with random weights, written by transformers."""
    import torch
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, sliding_window=12, query_pre_attn_scalar=16, max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).save_pretrained(directory)
    return directory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", nargs="?", help="an HF checkpoint directory")
    ap.add_argument("--prompt", default="The quick brown fox", help="text (needs the checkpoint's tokenizer)")
    ap.add_argument("--tiny", action="store_true", help="build and load a tiny random checkpoint instead")
    args = ap.parse_args()
    if (args.checkpoint is None) == (not args.tiny):
        ap.error("give a checkpoint directory or --tiny")

    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_hf_checkpoint(tmp) if args.tiny else args.checkpoint
        llm = LLM(path, device="cpu" if args.tiny else "auto", kv_cache_memory="64MiB" if args.tiny else None)
        print(f"{llm.model.config.architecture}: {len(llm.model.config.layers)} layers; {llm.plan.summary()}")
        prompt = args.prompt if llm.tokenizer is not None else [2, 17, 42, 99, 7]   # (a random checkpoint: ids)
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
        print("tokens:", list(out.outputs[0].token_ids))
        if out.outputs[0].text is not None:
            print("text:", out.outputs[0].text)
        if args.tiny:                      # the same greedy tokens as transformers
            import torch
            import transformers

            hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
            ids = torch.tensor([out.prompt_token_ids])
            want = hf.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
            print("transformers:", want, "(equal)" if want == list(out.outputs[0].token_ids) else "(DIFFERENT)")
            if want != list(out.outputs[0].token_ids):
                raise SystemExit(1)


if __name__ == "__main__":
    main()
