"""The host-memory checkpoint tier at full size, without a model: hit rates by staging rows and moves a commit starts.

    python benchmarks/host_checkpoints_sim.py [--families mamba2] [--save]

The real scheduler, coordinator and state-slot pool over a runner that computes nothing
(``prefix_caching.Simulated``: 256 sequences, 24 GiB, bf16 states, a 4096-token step budget as ``serving.py``
runs the Mamba models), on ``serving.py``'s workloads: *multi-turn* (64 conversations x 4 turns, two passes) and
*repeat* (the mixed prompts again after them). Per configuration: the staging rows the plan takes out of the device
checkpoint slots (``plan.HOST_STAGING_SLOTS``) and the moves to host memory a commit may start (what
``host_moves_available`` reports on a GPU once the rows' copies have landed); "no tier" has no host memory.
What a GPU adds (copy times, the link's rate) is not modelled: these are the pool's decisions only.

Writes ``benchmarks/out/host_checkpoints_sim.json`` (``--save``: ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))

import prefix_caching  # noqa: E402
from _results import add_output_args, commit, write_json  # noqa: E402
from serving import MULTITURN_TURNS, make_workload, next_turn  # noqa: E402

from hybridkv import SamplingParams  # noqa: E402
from hybridkv.kv_groups import plan as plan_module  # noqa: E402

HOST = 32 << 30
CONFIGS = [("no tier", 0, None), ("16 rows, 8 moves a commit", 16, 8), ("16 rows taken from elsewhere", 0, 8),
           ("8 rows, 4 moves", 8, 4), ("8 rows, 2 moves", 8, 2), ("4 rows, 2 moves", 4, 2)]


def _engine(family: str, rows: int, moves: int | None) -> prefix_caching.Simulated:
    # rows 0 with moves: the tier with every device checkpoint slot kept (rows from outside the plan)
    with mock.patch.object(plan_module, "HOST_STAGING_SLOTS", rows):
        llm = prefix_caching.Simulated(family, caching=True, kv_memory=24 << 30, requests=256, step_tokens=4096,
                                       host_cache_memory=HOST if moves is not None else 0)
    if moves is not None:
        llm.engine.runner.host_moves_available = lambda: moves
    return llm


def _generate(llm: prefix_caching.Simulated, prompts: list[list[int]], new: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def multiturn(llm: prefix_caching.Simulated) -> list[float]:
    """Hit / reusable tokens of each of two passes."""
    vocab, bs = llm.model.config.vocab_size, llm.plan.block_size
    rates = []
    for seed in (0, 1):
        w = make_workload("multiturn", seed, vocab, bs, tiny=False)
        before = llm.stats().prefix_hit_tokens
        for t in range(MULTITURN_TURNS):
            answers = _generate(llm, w.turns[t], w.new_tokens)
            if t + 1 < MULTITURN_TURNS:
                next_turn(w, answers, seed + 1000 + t, vocab, bs, False)
        rates.append((llm.stats().prefix_hit_tokens - before) / sum(sum(r) for r in w.reusable))
    return rates


def repeat(llm: prefix_caching.Simulated) -> list[float]:
    vocab, bs = llm.model.config.vocab_size, llm.plan.block_size
    mixed = make_workload("mixed", 0, vocab, bs, tiny=False)
    _generate(llm, mixed.turns[0], mixed.new_tokens)
    again = make_workload("repeat", 0, vocab, bs, tiny=False, mixed=mixed)
    before = llm.stats().prefix_hit_tokens
    _generate(llm, again.turns[0], again.new_tokens)
    return [(llm.stats().prefix_hit_tokens - before) / sum(sum(r) for r in again.reusable)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="mamba2")
    add_output_args(ap, "host_checkpoints_sim")
    args = ap.parse_args()
    logging.disable(logging.WARNING)            # (the pool's one-line "slots are full" notice, per engine)
    rows = []
    for family in args.families.split(","):
        for label, staging, moves in CONFIGS:
            row = {"family": family, "config": label, "staging_rows": staging, "moves_per_commit": moves}
            for name, workload in (("multiturn", multiturn), ("repeat", repeat)):
                llm = _engine(family, staging, moves)
                row[name] = workload(llm)
                row[f"{name}_device_checkpoint_slots"] = llm.plan.num_checkpoint_slots
            rows.append(row)
            print(f"{family:10s} {label:30s} multi-turn {', '.join(f'{r:.1%}' for r in row['multiturn']):16s} "
                  f"repeat {row['repeat'][0]:.1%}  ({row['multiturn_device_checkpoint_slots']} device slots)",
                  flush=True)
    meta = {"device": "cpu (no model)", "commit": commit(), "host_cache_memory": HOST}
    write_json(args, "host_checkpoints_sim", {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
