"""Mamba2 with several groups: hybridkv vs the installed transformers, fp32, same weights.

    python benchmarks/mamba2_hf_parity.py [--layers 2] [--tokens 300]

A random-init ``Mamba2ForCausalLM`` with Codestral's layer shapes narrowed (hidden 2048, 64 heads x 64,
state 128, **8 groups**) is saved by HF and loaded by hybridkv's HF loader; prints the relative error of
the logits of one prompt, HF vs hybridkv, on the CPU and (when present) on the GPU, and the transformers
version. With transformers 5.23 they agree to ~3e-7; 5.17 (the GPU machine's) normalises the gated RMSNorm
over the whole inner dimension instead of per group, and differs by ~0.8 (docs/performance.md, "Accuracy").
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import transformers

from hybridkv.engine.model_runner import reference_logits
from hybridkv.loaders.checkpoint import load_hf_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=300)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = transformers.Mamba2Config(hidden_size=2048, num_hidden_layers=args.layers, num_heads=64, head_dim=64,
                                    state_size=128, n_groups=8, expand=2, conv_kernel=4, chunk_size=256,
                                    vocab_size=32768, tie_word_embeddings=False)
    cfg.architectures = ["Mamba2ForCausalLM"]
    hf = transformers.Mamba2ForCausalLM(cfg).eval()
    path = tempfile.mkdtemp(prefix="hkv-mamba2-")
    hf.save_pretrained(path)
    ids = torch.randint(0, cfg.vocab_size, (1, args.tokens))
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    print(f"transformers {transformers.__version__}, {args.layers} layers, {args.tokens} tokens, fp32")
    for device in devices:
        with torch.no_grad():
            ref = hf.to(device)(ids.to(device)).logits[0].float().cpu()
        ours = reference_logits(load_hf_checkpoint(path, dtype=torch.float32, device=device), ids[0].tolist(),
                                backend="torch").float().cpu()
        print(f"{device}: rel. error hybridkv vs HF = {float((ours - ref).norm() / ref.norm()):.2e}")


if __name__ == "__main__":
    main()
