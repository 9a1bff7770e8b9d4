"""Host-side cost of the KV-cache coordinator + block tables for one decode step.

256 concurrent decoding requests over 4 groups (full, sliding(1024), chunked(8192), Mamba; block size
16). One scheduler step = ``allocate_batch`` (free skipped, a new block every 16 tokens) + the Mamba
state-copy queue + slot mapping for every group + state indices + ``commit_batch`` (register full
blocks, free skipped). Prompts have staggered lengths, so ~1/16 of the requests cross a block boundary
each step, as in steady-state serving. Also timed: the per-request API doing the same work, admission
(prefix lookup + allocate + commit of a prompt), free, and the block-table device copy.

Decode steps are timed in 64-step windows over 3 seeds: the best window is the uncontended cost, the
median what a host shared with other jobs sees (both are reported; the JSON keeps the load average).

    python benchmarks/kv_groups.py [--requests 256] [--steps 2000] [--save | --out PATH]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from _results import add_output_args, commit, write_json  # noqa: E402

from hybridkv.kv_groups.block_table import MultiGroupBlockTable
from hybridkv.kv_groups.coordinator import KVCacheCoordinator
from hybridkv.kv_groups.plan import KVCachePlan, plan_kv_cache
from hybridkv.kv_groups.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec

BS = 16
MAX_LEN = 16384


def make_plan(num_requests: int) -> KVCachePlan:
    attn = dict(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float16)
    layers = {
        "full": FullAttentionSpec(**attn),
        "sliding": SlidingWindowSpec(sliding_window=1024, **attn),
        "chunked": ChunkedLocalAttentionSpec(attention_chunk_size=8192, **attn),
        "mamba": MambaSpec(block_size=BS, shapes=((4, 8), (2, 4, 4)), dtypes=(torch.float16, torch.float32)),
    }
    probe = plan_kv_cache(layers, max_model_len=MAX_LEN, kv_memory=1 << 34, max_num_seqs=num_requests)
    need = num_requests * probe.bytes_per_request_max * 5 // 4 + (probe.reserved_step_blocks + 1) * probe.page_bytes
    return plan_kv_cache(layers, max_model_len=MAX_LEN, kv_memory=need, max_num_seqs=num_requests,
                         num_checkpoint_slots=64)


def setup(plan: KVCachePlan, n: int, steps: int, seed: int, **kw: Any) -> tuple[KVCacheCoordinator, list,
                                                                                 np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    c = KVCacheCoordinator(plan, max_num_reqs=n, **kw)
    prompts = rng.integers(2000, MAX_LEN - steps - 1, n)
    tokens = [rng.integers(0, 32000, int(p) + steps + 1).astype(np.int64) for p in prompts]
    for i, (p, toks) in enumerate(zip(prompts.tolist(), tokens, strict=True)):
        rid = f"r{i}"
        hit = c.find_prefix_hit(rid, toks[:p])
        assert c.allocate(rid, num_computed_tokens=hit, num_new_tokens=p - hit, token_ids=toks)
        c.commit(rid, num_computed_tokens=p)
    rows = np.array([c.row_of(f"r{i}") for i in range(n)], np.intp)
    return c, tokens, rows, prompts.astype(np.int64)


def decode_batch(c: KVCacheCoordinator, rows: np.ndarray, nc: np.ndarray, steps: int,
                 window: int = 64) -> list[float]:
    """µs per step of the whole batch-shaped step API, one mean per window of ``window`` steps."""
    ones = np.ones(rows.size, np.int64)
    tables = c.block_tables
    out = []
    for _ in range(steps // window):
        t0 = time.perf_counter()
        for _ in range(window):
            ok = c.allocate_batch(rows, nc, ones)
            src, dst = c.take_state_copies()
            slots = tables.slot_mapping(rows, nc)       # (G, B) KV write slots of the new tokens
            state_idx = c.state_slots(rows)              # (B,) Mamba state indices
            nc = nc + 1
            c.commit_batch(rows, nc)
        out.append((time.perf_counter() - t0) / window * 1e6)
        assert ok and slots.shape == (3, rows.size) and state_idx.shape == rows.shape and src.size == dst.size
    return out


def decode_per_request(c: KVCacheCoordinator, rows: np.ndarray, nc: np.ndarray, steps: int) -> float:
    ids = [c.request_at(int(r)) for r in rows]
    tables = c.block_tables
    t0 = time.perf_counter()
    for _ in range(steps):
        for rid, n in zip(ids, nc.tolist(), strict=True):
            c.allocate(rid, num_computed_tokens=n, num_new_tokens=1)
        c.take_state_copies()
        tables.slot_mapping(rows, nc)
        nc = nc + 1
        for rid, n in zip(ids, nc.tolist(), strict=True):
            c.commit(rid, num_computed_tokens=n)
    return (time.perf_counter() - t0) / steps * 1e6


def admission_and_free(plan: KVCachePlan, n: int, prompt: int) -> tuple[float, float, float]:
    """µs per request: cold admission (prefill allocate + commit), warm admission (full prefix hit),
    free."""
    rng = np.random.default_rng(1)
    c = KVCacheCoordinator(plan, max_num_reqs=n)
    toks = [rng.integers(0, 32000, prompt).astype(np.int64) for _ in range(n // 2)]
    t0 = time.perf_counter()
    for i, t in enumerate(toks):
        hit = c.find_prefix_hit(f"a{i}", t)
        c.allocate(f"a{i}", num_computed_tokens=hit, num_new_tokens=prompt - hit, token_ids=t)
        c.commit(f"a{i}", num_computed_tokens=prompt)
    cold = (time.perf_counter() - t0) / len(toks) * 1e6
    t0 = time.perf_counter()
    for i, t in enumerate(toks):
        hit = c.find_prefix_hit(f"b{i}", t)
        c.allocate(f"b{i}", num_computed_tokens=hit, num_new_tokens=prompt - hit, token_ids=t)
        c.commit(f"b{i}", num_computed_tokens=prompt)
    warm = (time.perf_counter() - t0) / len(toks) * 1e6
    t0 = time.perf_counter()
    for i in range(len(toks)):
        c.free(f"a{i}")
        c.free(f"b{i}")
    free = (time.perf_counter() - t0) / (2 * len(toks)) * 1e6
    return cold, warm, free


def table_copy(n: int, groups: int, reps: int = 200) -> float:
    """µs for ``commit(n)`` of a non-shared mirror (the H2D copy path, here CPU to CPU) with the
    longest row at half of max_model_len."""
    t = MultiGroupBlockTable(groups, n, MAX_LEN // BS, block_size=BS, share_host_memory=False)
    t.num_blocks[:n] = MAX_LEN // BS // 2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # a 1.5 MB copy; intra-op threads only add contention on a shared host
    t0 = time.perf_counter()
    for _ in range(reps):
        t.commit(n)
    us = (time.perf_counter() - t0) / reps * 1e6
    torch.set_num_threads(threads)
    return us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2000)
    add_output_args(ap, "kv_groups")
    args = ap.parse_args()
    n, steps = args.requests, args.steps
    plan = make_plan(n)
    rows_out: list[tuple[str, float, str]] = []

    stats: dict[str, dict[str, float]] = {}
    for label, kw in (("blake2b keys", {}), ("builtin keys", {"hash_algorithm": "builtin"}),
                      ("prefix caching off", {"enable_prefix_caching": False})):
        windows: list[float] = []
        for seed in range(3):
            c, _, rows, nc = setup(plan, n, steps, seed, **kw)
            windows += decode_batch(c, rows, nc, steps)
            c.check_invariants()
        name = f"decode step, batch API ({label})"
        # The host is shared with other jobs: the best 64-step window is the uncontended cost,
        # the median says what a loaded host sees.
        stats[name] = {"best_window_us": min(windows), "median_window_us": float(np.median(windows))}
        rows_out.append((name, min(windows), f"{n} requests, per step (median {np.median(windows):.1f})"))

    def run_per_request() -> float:
        c, _, rows, nc = setup(plan, n, steps, 0)
        return decode_per_request(c, rows, nc, min(steps, 200))
    rows_out.append(("decode step, per-request API", run_per_request(), f"{n} requests, per step"))
    cold, warm, free = admission_and_free(plan, n, 4096)
    rows_out += [("admit 4096-token prompt (cold)", cold, "per request"),
                 ("admit 4096-token prompt (full prefix hit)", warm, "per request"),
                 ("free", free, "per request"),
                 ("block_tables.commit (copy path)", table_copy(n, 3),
                  f"{n} rows x {MAX_LEN // BS // 2} cols x 3 groups")]

    table = Table(title=f"kv_groups host cost — {n} requests, 4 groups (full, sliding 1024, chunked 8192, "
                        f"mamba), block size {BS}")
    table.add_column("operation")
    table.add_column("µs", justify="right")
    table.add_column("unit")
    for name, us, unit in rows_out:
        table.add_row(name, f"{us:.1f}", unit)
    Console().print(table)
    target = rows_out[0][1]
    Console().print(f"target <= 100 µs per decode step: {'met' if target <= 100 else 'NOT met'} ({target:.1f} µs)")

    write_json(args, "kv_groups", {
        "benchmark": "kv_groups", "commit": commit(), "command": " ".join(sys.argv),
        "requests": n, "steps": steps, "block_size": BS, "max_model_len": MAX_LEN,
        "groups": ["full", "sliding_window(1024)", "chunked_local(8192)", "mamba"],
        "results_us": {name: round(us, 2) for name, us, _ in rows_out},
        "decode_windows": {k: {kk: round(vv, 2) for kk, vv in v.items()} for k, v in stats.items()},
        "load_average_at_end": list(os.getloadavg()),
        "target_us_per_decode_step": 100, "met": target <= 100,
        "machine": {"python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
                    "processor": platform.processor() or platform.machine()},
    }, indent=2)


if __name__ == "__main__":
    main()
