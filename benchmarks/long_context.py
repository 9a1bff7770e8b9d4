"""Long-context concurrency: how many 32k-token requests the real scheduler admits at once under a fixed
KV budget, Gemma-3-like mix (5 sliding-window(1024) : 1 global, 26 layers) vs the same model with every
layer global (what a uniform full-attention allocator holds).

    python benchmarks/long_context.py [--context 32768] [--window 1024] [--full-requests 8]

The budget is what ``--full-requests`` requests of ``--context`` tokens need as full attention, so the
all-global run admits that many. Admission is the engine's own (scheduler + KV coordinator, chunked
prefill, the real plan); only the model is skipped: each scheduled chunk is committed as computed and a
fixed token stands in for sampling, so this runs in seconds on a CPU. The head dims are small because the
ratio depends only on token-layers held (the pools scale with them). Target: >= 4.5x (ideal ~5.3x).
Prints a table and writes ``long_context.json`` (``--save``: the tracked result, see ``_results.py``).
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from _results import add_output_args, commit, write_json  # noqa: E402

from hybridkv import LLM, SamplingParams
from hybridkv.models import MLP, Attention, HybridConfig, Layer

NUM_LAYERS = 26
HEAD = dict(num_heads=1, num_kv_heads=1, head_dim=16)


def gemma3_like(context: int, window: int | None) -> HybridConfig:
    """Gemma-3 layer pattern (every 6th layer global); ``window=None`` makes every layer global."""
    layers = tuple(Layer(mixer=Attention(sliding_window=None if (i + 1) % 6 == 0 else window, **HEAD),
                         ffn=MLP(intermediate_size=16)) for i in range(NUM_LAYERS))
    return HybridConfig(vocab_size=64, hidden_size=16, max_position_embeddings=context + 1024, dtype="float32",
                        layers=layers)


def full_request_bytes(context: int, block_size: int = 16) -> int:
    per_token_layer = 2 * HEAD["num_kv_heads"] * HEAD["head_dim"] * 4            # K and V, fp32
    return NUM_LAYERS * -(-context // block_size) * block_size * per_token_layer


def admitted(config: HybridConfig, *, context: int, budget: int, max_seqs: int, steps: int) -> dict[str, int]:
    """Max requests running at once (and preemptions) over ``steps`` model-free engine steps."""
    llm = LLM(config, device="cpu", kv_cache_memory=budget, max_num_seqs=max_seqs, max_model_len=context + 1024,
              max_num_batched_tokens=8192, enable_prefix_caching=False)
    engine, sched, coord = llm.engine, llm.engine.scheduler, llm.engine.coordinator
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    rng = np.random.default_rng(0)
    for i in range(max_seqs):
        engine.add_request(str(i), rng.integers(0, 64, context).tolist(), params)
    most = 0
    for _ in range(steps):
        batch = sched.schedule()
        ends = batch.num_computed + batch.num_new_tokens
        done = ends == sched.row_num_tokens[batch.rows]            # reached its end: "samples" a token
        for i in np.flatnonzero(done).tolist():
            batch.requests[i].token_ids.append(1)
        sched.add_sampled(batch.rows[done])
        sched.set_last_tokens(batch.rows[done], np.ones(int(done.sum()), np.int64))
        coord.commit_batch(batch.rows, ends)
        most = max(most, len(sched.running))
        for req in [r for r in batch.requests if r.num_output_tokens >= params.max_tokens]:
            sched.finish(req)
    return {"max_running": most, "preemptions": sched.num_preemptions, "num_blocks": llm.plan.num_blocks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--full-requests", type=int, default=8)
    parser.add_argument("--steps", type=int, default=600)
    add_output_args(parser, "long_context")
    args = parser.parse_args()
    budget = args.full_requests * full_request_bytes(args.context + 256)
    max_seqs = 12 * args.full_requests
    rows = {
        "hybridkv (5 sliding : 1 global)": admitted(gemma3_like(args.context, args.window), context=args.context,
                                                    budget=budget, max_seqs=max_seqs, steps=args.steps),
        "full attention (all global)": admitted(gemma3_like(args.context, None), context=args.context,
                                                budget=budget, max_seqs=max_seqs, steps=args.steps),
    }
    hybrid, full = (r["max_running"] for r in rows.values())
    ratio = hybrid / max(full, 1)
    table = Table(title=f"{args.context}-token requests admitted at once, KV budget {budget / 2**20:.0f} MiB "
                        f"(window {args.window})")
    for col in ("allocation", "max running", "preemptions", "pool blocks"):
        table.add_column(col, justify="right")
    for name, r in rows.items():
        table.add_row(name, str(r["max_running"]), str(r["preemptions"]), str(r["num_blocks"]))
    Console().print(table)
    Console().print(f"concurrency ratio: {ratio:.2f}x (target >= 4.5x)")
    write_json(args, "long_context", {"cpu": platform.machine(), "commit": commit(), "command": " ".join(sys.argv),
                                      "context": args.context, "window": args.window, "budget_bytes": budget,
                                      "rows": rows, "ratio": ratio})


if __name__ == "__main__":
    main()
