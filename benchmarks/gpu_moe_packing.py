"""Llama-4-like decode with the routed experts' gate|up packed (``MoEFeedForward.fuse_projections``) vs not,
alternating on one machine in one run (the lent hosts' speeds differ too much to compare across runs).

    python benchmarks/gpu_moe_packing.py [--reps 2]

Same model and timing as ``gpu_decode.py`` (random-init HF Llama-4-like 1.21B saved and loaded, bf16, CUDA
graphs, asynchronous scheduling, 512-token prompts, 32 decode steps); prints the median step and the graph
replayed alone per batch size. CUDA only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_decode import hf_config, run_hybridkv  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_moe_packing.py needs a CUDA device")
    from hybridkv import LLM
    from hybridkv.layers.moe import MoEFeedForward

    config, cls = hf_config("llama4", False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = cls(config).to(torch.bfloat16)
    tmp = tempfile.mkdtemp(prefix="hkv-moe-")
    hf.save_pretrained(tmp)
    del hf
    fuse = MoEFeedForward.fuse_projections
    device = torch.device("cuda")
    try:
        for rep in range(args.reps):
            for packed in (True, False):
                MoEFeedForward.fuse_projections = fuse if packed else (lambda self: None)
                llm = LLM(tmp, dtype=torch.bfloat16, device="cuda", backend="triton", max_model_len=8256,
                          max_num_seqs=65, enable_prefix_caching=False, kv_cache_memory="4GiB")
                cells = []
                for batch in (1, 32, 64):
                    rng = np.random.default_rng(batch)
                    prompts = [rng.integers(10, config.vocab_size, 512).tolist() for _ in range(batch)]
                    run_hybridkv(llm, prompts[:1], 2, device)          # warm-up
                    r = run_hybridkv(llm, prompts, 32, device)
                    cells.append(f"B={batch} step {statistics.median(r['step_times']) * 1e3:.3f} ms, "
                                 f"replay {r['replay_ms']:.3f} ms")
                print(f"rep {rep} packed={packed}: " + " | ".join(cells), flush=True)
                del llm
                torch.cuda.empty_cache()
    finally:
        MoEFeedForward.fuse_projections = fuse


if __name__ == "__main__":
    main()
