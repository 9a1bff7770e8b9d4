"""Tensor parallelism on the CPU (gloo, 2 processes): the same tokens and logits as one process.

Every layer mix (chunked-local + global with MoE, sliding, pure Mamba2, Mamba2 + attention + Mamba-1 + latent MoE,
short convs + attention) runs through ``LLM(..., tensor_parallel_size=2)`` and must give the greedy tokens of
``tensor_parallel_size=1`` with every step's logits within 1e-5 (fp32). HF checkpoints load at tp 2 (each rank reads
its shard); in-process checks show each rank's parameters are exactly the shards of the full ones for every
supported family, and every family served at tp 2 (one checkpoint per distinct sharding) gives tp 1's tokens with
logits within 1e-5 (or within fp32's own round-off of that checkpoint, when larger). Bad input fails fast with an
error naming the dimension, and a dead or stuck rank is an error within the timeout, never a hang — also when it
fails inside a step's forward (ranks spawned through ``_tp_fault_worker``), and a spawned rank exits when rank 0
dies. Rank 0 may be started any way at all (``python -c``, stdin, a script without a ``__main__`` guard): the
spawned ranks never import it. Random init drawn on the device (``init="device"``, chunked) is also exactly the
shard of the full init.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _hf_mamba_models as hf_mamba
import _hf_models as hf_attention
import pytest
import torch
from _tp_fault_worker import EXIT_CODE, fault_command
from _tp_helpers import ENGINE_ARGS, GREEDY, MIXES, VOCAB, max_logit_diff, prompts, run

from hybridkv import LLM, plan
from hybridkv.cli import main
from hybridkv.engine import distributed
from hybridkv.engine.distributed import ParallelContext, TensorParallelError, pack_step, unpack_step
from hybridkv.layers.parallel import Shard, Split, TensorParallel
from hybridkv.loaders.checkpoint import load_hf_checkpoint
from hybridkv.models import MLP, Attention, HybridConfig, Layer, Mamba2, MoE, ShortConv, hybrid
from hybridkv.models.hybrid import build_model

TOL = 1e-5


# -- equivalence through the engine -------------------------------------------------------------------------
@pytest.mark.parametrize("mix", [pytest.param(m, marks=pytest.mark.slow) if m in ("llama4_like", "lfm2_like", "mamba2")
                                 else m for m in MIXES])
def test_tp2_matches_tp1(mix: str) -> None:
    config = MIXES[mix]()
    batch = prompts(VOCAB)
    one, two = run(config, 1, batch), run(config, 2, batch)
    assert two.tokens == one.tokens
    assert len({t for seq in one.tokens for t in seq}) >= 5, f"{mix}: degenerate greedy output"
    assert max_logit_diff(one, two) <= TOL
    if any(isinstance(layer.mixer, Mamba2 | ShortConv) for layer in config.layers):
        assert two.copies, "prefix hits should have copied Mamba states (sent to rank 1 with the next step)"


# Every supported family as a tiny HF checkpoint (seeds as in the parity tests: non-degenerate greedy output).
_ATTENTION_SEEDS = {"llama4": 2, "llama4_multimodal": 0, "mistral": 0, "gemma2": 1, "gemma3": 0,
                    "gemma3_multimodal": 0, "mamba2": 0, "gpt_oss": 0, "cohere2": 1, "exaone4": 0, "granite_swa": 0,
                    "granitemoe_swa": 0}
HF_FAMILIES = [*_ATTENTION_SEEDS, *hf_mamba.BUILDERS]


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, seed in _ATTENTION_SEEDS.items():
        out[name] = hf_attention.save(hf_attention.FAMILIES[name](seed), tmp_path_factory.mktemp(name))
    for name, build in hf_mamba.BUILDERS.items():
        out[name] = tmp_path_factory.mktemp(name)
        build().save_pretrained(out[name])
    return out


# gpt-oss ~11 s, Qwen3-Next ~16 s, Qwen3.5 ~12 s, OLMo-Hybrid ~26 s; LFM2-MoE's sharded experts are those of the
# other MoE families, its short convs LFM2's (quick); Jamba's, Zamba2's and Bamba's Mamba and attention shards are
# NemotronH's and Falcon-H1's (quick). Qwen3.5-MoE's and the multimodal Qwen3.5's shards are Qwen3.5's and
# Qwen3-Next's, OLMo-Hybrid NoPE's OLMo-Hybrid's: their loading is checked below, not served again. Falcon-H1 with
# its gated norm and the Granite hybrids shard as Falcon-H1, NemotronH and the MoE families do; the multimodal
# wrappers' decoders are Llama-4's and Gemma-3's; Mistral's, Cohere2's, EXAONE-4's and Granite-SWA's attention
# shards are Gemma-2's and Gemma-3's (full and sliding, q/k norms, sinks in gpt-oss): each quick elsewhere.
# GraniteMoE-SWA (sinks split by heads, experts and the shared MLP by channels) is served quick (~2 s).
_TP2_SLOW = ("gpt_oss", "lfm2_moe", "qwen3_next", "jamba", "zamba2", "bamba", "qwen3_5", "olmo_hybrid",
             "lfm2", "falcon_h1", "mamba2", "gemma2", "llama4",    # (NemotronH and Gemma-3 stay in the quick tier)
             "falcon_h1_gated_norm", "granite_dense_rope", "granite_moe_hybrid", "llama4_multimodal",
             "gemma3_multimodal", "mistral", "cohere2", "exaone4", "granite_swa")
_TP2_SHARDS_ONLY = ("qwen3_5_moe", "qwen3_5_vl", "olmo_hybrid_nope")


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in _TP2_SLOW else f
                                    for f in HF_FAMILIES if f not in _TP2_SHARDS_ONLY])
def test_hf_checkpoint_at_tp2(family: str, hf_checkpoints: dict[str, Path]) -> None:
    """Each rank reads its shard of the hub tensors (fused or per-expert experts, Zamba2's shared blocks
    and adapters, Falcon-H1's parallel mixer and µP sections, Jamba's Mamba-1, tied embeddings, gpt-oss's
    sinks (split by heads) and expert biases (the down bias added once, by rank 0), ...)."""
    batch = prompts(hf_attention.VOCAB, n=2, seed=3)
    one = run(hf_checkpoints[family], 1, batch, max_model_len=128)
    two = run(hf_checkpoints[family], 2, batch, max_model_len=128)
    assert two.tokens == one.tokens
    diff = max_logit_diff(one, two)
    if diff > TOL:
        # These checkpoints use HF-scale weights; Zamba2's is sensitive enough that fp32 round-off alone
        # moves its logits by ~3e-5 (against an fp64 run). Summing partial products in another order must
        # not move them by more than fp32 itself does.
        exact = run(hf_checkpoints[family], 1, batch, max_model_len=128, dtype="float64")
        assert diff <= 2 * max_logit_diff(one, exact), f"{family}: max |logit diff| {diff:.3g}"


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_hf_loading_gives_each_rank_its_shard(family: str, hf_checkpoints: dict[str, Path]) -> None:
    """No processes: load every family as rank 0 and rank 1 of 2 and compare with the full model's shards
    (Zamba2: shared blocks and their adapters; Jamba: Mamba-1 and per-expert tensors)."""
    full = load_hf_checkpoint(hf_checkpoints[family], dtype=torch.float32)
    params = dict(full.named_parameters())
    for rank in range(2):
        shard = load_hf_checkpoint(hf_checkpoints[family], dtype=torch.float32, tp=TensorParallel(rank=rank, size=2))
        rules = shard.parameter_shards()
        assert any(r.dim for r in rules.values()), "some parameters split along dim > 0 (row-parallel)"
        for name, p in shard.named_parameters():
            want = rules[name].take(params[name], shard.tp) if name in rules else params[name]
            assert torch.equal(p, want), f"{family} rank {rank}: {name}"


def test_random_init_is_the_shard_of_the_full_init() -> None:
    config = MIXES["mamba_hybrid"]()
    full = dict(build_model(config, seed=4).named_parameters())
    for rank in range(2):
        shard = build_model(config, seed=4, tp=TensorParallel(rank=rank, size=2))
        for name, p in shard.named_parameters():
            assert torch.equal(p, shard.shard_of(name, full[name])), name


@pytest.mark.parametrize("mix", ["mamba_hybrid", "llama4_like", "sliding"])
def test_device_init_is_the_shard_of_the_full_init(mix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``init="device"`` (here on the CPU, with tiny chunks so every tensor is drawn in many pieces along a dim
    it is not split on): each rank's parameters are exactly the shards of the tp-1 model's, the values are
    reproducible and distinct from the host draw, and ``init="auto"`` on the CPU is still the host draw."""
    monkeypatch.setattr(hybrid, "DEVICE_INIT_CHUNK", 40)
    config = MIXES[mix]()
    full = dict(build_model(config, seed=4, init="device").named_parameters())
    again = dict(build_model(config, seed=4, init="device").named_parameters())
    host = dict(build_model(config, seed=4, init="host").named_parameters())
    auto = dict(build_model(config, seed=4).named_parameters())
    for name, p in full.items():
        assert torch.equal(p, again[name]) and torch.equal(host[name], auto[name]), name
        if name.endswith("A_log") or (p.ndim == 1 and not name.endswith("dt_bias")):
            assert torch.equal(p, host[name]), name                   # constants, Mamba's A
        else:
            assert not torch.equal(p, host[name]), name               # drawn by another generator
            if p.ndim >= 2:
                assert 0.01 < p.std().item() < 0.03, name             # N(0, 0.02) like the host init
    for rank in range(2):
        shard = build_model(config, seed=4, init="device", tp=TensorParallel(rank=rank, size=2))
        for name, p in shard.named_parameters():
            assert torch.equal(p, shard.shard_of(name, full[name])), f"rank {rank}: {name}"
    with pytest.raises(ValueError, match="init must be one of"):
        build_model(config, init="gpu")


def test_in_memory_model_is_sharded_too() -> None:
    """A built model passed to LLM: its tensors reach the spawned rank (shared memory) and are sharded."""
    model = build_model(MIXES["sliding"](), seed=2)
    batch = prompts(VOCAB, n=2, seed=5)
    assert run(model, 2, batch).tokens == run(model, 1, batch).tokens


_TORCHRUN_SCRIPT = """
import json, os
from _tp_helpers import ENGINE_ARGS, GREEDY, MIXES, VOCAB, prompts
from hybridkv import LLM

llm = LLM(MIXES["mamba_hybrid"](), tensor_parallel_size=2, seed=1, distributed_timeout=60, **ENGINE_ARGS)
outs = llm.generate(prompts(VOCAB), GREEDY, use_tqdm=False)     # ranks > 0 never get here
print("TOKENS", os.environ["RANK"], json.dumps([list(o.outputs[0].token_ids) for o in outs]))
llm.shutdown()
"""


def _torchrun(tmp_path: Path, script: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "tp_torchrun.py"
    path.write_text(script)
    tests = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(path)],
                          capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.slow    # a process spawned and torn down: the full suite runs it
def test_torchrun_launch(tmp_path: Path) -> None:
    """Every process runs the same script; rank 1 serves inside ``LLM(...)`` and exits with rank 0."""
    done = _torchrun(tmp_path, _TORCHRUN_SCRIPT)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("TOKENS")]
    assert len(lines) == 1 and lines[0].startswith("TOKENS 0 ")
    assert json.loads(lines[0].split(" ", 2)[2]) == run(MIXES["mamba_hybrid"](), 1, prompts(VOCAB)).tokens


@pytest.mark.slow    # a process spawned and torn down: the full suite runs it
def test_a_rank_failing_at_startup_is_reported_by_rank_0(tmp_path: Path) -> None:
    """Rank 1 cannot load its shard: rank 0 raises rank 1's error at once (no timeout to wait out)."""
    failing = _TORCHRUN_SCRIPT.replace("from hybridkv import LLM\n", """from hybridkv import LLM
import hybridkv.engine.llm as llm_module

def _broken(*args, **kwargs):
    raise OSError("disk on fire")

if os.environ["RANK"] == "1":
    llm_module._load = _broken
""")
    start = time.monotonic()
    done = _torchrun(tmp_path, failing)
    assert done.returncode != 0 and time.monotonic() - start < 50
    assert "TensorParallelError: tensor-parallel rank 1 failed while loading the model: OSError: disk on fire" \
        in done.stderr


_LAUNCHED = """
import json, sys
sys.path.insert(0, {tests!r})
from _tp_helpers import ENGINE_ARGS, GREEDY, MIXES, VOCAB, prompts
from hybridkv import LLM

llm = LLM(MIXES["mamba2"](), tensor_parallel_size=2, seed=1, distributed_timeout=60, **ENGINE_ARGS)
outs = llm.generate(prompts(VOCAB, n=2), GREEDY, use_tqdm=False)
print("TOKENS", json.dumps([list(o.outputs[0].token_ids) for o in outs]))
llm.shutdown()
"""


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["python -c", "stdin", "script without a __main__ guard"])
def test_rank_0_started_any_way(launcher: str, tmp_path: Path) -> None:
    """The spawned rank is a fresh ``python -m hybridkv.engine.worker``: it never imports rank 0's
    ``__main__``, which here has no guard (re-running it would spawn again) or is no file at all."""
    code = _LAUNCHED.format(tests=str(Path(__file__).parent))
    stdin = None
    if launcher == "python -c":
        cmd = [sys.executable, "-c", code]
    elif launcher == "stdin":
        cmd, stdin = [sys.executable, "-"], code
    else:
        (tmp_path / "unguarded.py").write_text(code)
        cmd = [sys.executable, str(tmp_path / "unguarded.py")]
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(lines) == 1, done.stdout
    assert json.loads(lines[0][7:]) == run(MIXES["mamba2"](), 1, prompts(VOCAB, n=2)).tokens


def test_a_rank_that_fails_to_start_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The spawned rank's own error reaches rank 0's (``int("not a number")`` stands for any job that raises
    before joining), at once; the job's files are gone afterwards."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rendezvous failed \(.*rank 1 exited with code 1: ValueError: "
                                                  r"invalid literal for int\(\) with base 10: 'not a number'"):
        distributed.spawn_group(2, torch.device("cpu"), 60.0, int, ("not a number",))
    assert time.monotonic() - start < 30
    assert not list(tmp_path.iterdir())


def test_launcher_size_must_match(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="tensor_parallel_size=2, but the launcher started WORLD_SIZE=4"):
        LLM(MIXES["mamba2"](), tensor_parallel_size=2, **ENGINE_ARGS)


# -- sharding rules -----------------------------------------------------------------------------------------
def test_split_rules() -> None:
    tp = [TensorParallel(rank=r, size=4) for r in range(4)]
    kv = Split(2 * 3, 2, replicate=True)                         # 2 kv heads of 3 over 4 ranks
    assert [kv.part(4, t.rank) for t in tp] == [(0, 3), (0, 3), (3, 3), (3, 3)]
    vocab = Split(10, 10, pad=True)                              # 10 rows over 4 ranks: 3, 3, 3, 1 + pad
    full = torch.arange(10.0)[:, None]
    parts = [Shard(0, (vocab,)).take(full, t) for t in tp]
    assert [p.shape[0] for p in parts] == [3] * 4 and torch.equal(torch.cat(parts)[:10], full)
    fused = Shard(0, (Split(4, 2), Split(2, 2)))                 # z|dt sections, split section by section
    assert fused.take(torch.arange(6), TensorParallel(rank=1, size=2)).tolist() == [2, 3, 5]


def test_step_message_round_trip() -> None:
    import numpy as np

    tables = [np.array([[1, 2, 0], [3, 4, 5]], np.int32), np.array([[7], [8]], np.int32)]
    header, payload = pack_step(np.array([5, 6, 7]), np.array([1, 2]), np.array([4, 9]), tables,
                                np.array([0, 2]), [(3, 4)])
    out = unpack_step(header, payload)
    assert out["input_ids"].tolist() == [5, 6, 7] and out["copies"] == [(3, 4)]
    assert [t.tolist() for t in out["block_tables"]] == [t.tolist() for t in tables]
    assert out["block_tables"][0].dtype == np.int32
    assert distributed.payload_size(header) == payload.numel()


def test_per_rank_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """Per-GPU bytes: kv heads halve (8 kv heads at tp 2); a Mamba state holds half the heads and, with
    one group, the whole group on each rank; the same budget per GPU then admits about twice as many."""
    one = plan("llama4-scout", max_model_len=131072, kv_memory="40GiB")
    two = plan("llama4-scout", max_model_len=131072, kv_memory="40GiB", tensor_parallel_size=2)
    assert two.bytes_per_request_max * 2 == one.bytes_per_request_max
    assert two.max_concurrent_requests >= 2 * one.max_concurrent_requests
    bamba = plan("bamba-9b", max_model_len=4096, kv_memory="40GiB", tensor_parallel_size=2)
    mamba = next(g.spec for g in bamba.groups if not g.spec.is_attention)
    assert mamba.shapes == ((64 * 64 + 2 * 128, 3), (64, 64, 128))
    assert main(["plan", "llama4-scout", "--tensor-parallel-size", "2", "--kv-memory", "40GiB", "--json"]) == 0
    assert '"tensor_parallel_size": 2' in capsys.readouterr().out


# -- bad input and failures ---------------------------------------------------------------------------------
def test_tp_that_does_not_divide_heads_is_a_clear_error() -> None:
    config = MIXES["llama4_like"]()
    with pytest.raises(ValueError, match=r"layers\.0 \(Attention\): num_heads=4 must be divisible by "
                                         r"tensor_parallel_size=3"):
        LLM(config, tensor_parallel_size=3, **ENGINE_ARGS)
    mamba = HybridConfig(vocab_size=VOCAB, hidden_size=32, layers=(
        Layer(mixer=Attention(num_heads=2, num_kv_heads=1, head_dim=4)),
        Layer(mixer=Mamba2(num_heads=6, head_dim=8, state_size=8, n_groups=3))))
    with pytest.raises(ValueError, match=r"layers\.1 \(Mamba2\): n_groups=3 must be divisible by "
                                         r"tensor_parallel_size=2 or divide it"):
        mamba.check_tensor_parallel(2)
    kv = HybridConfig(vocab_size=VOCAB, hidden_size=32, layers=(
        Layer(mixer=Attention(num_heads=6, num_kv_heads=3, head_dim=4)),))
    with pytest.raises(ValueError, match=r"num_kv_heads=3"):
        kv.kv_specs(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="num_heads=40"):
        plan("llama4-scout", kv_memory="40GiB", tensor_parallel_size=3)
    # Experts are split inside (by intermediate channels), so their count never matters; the channels do.
    attn = Attention(num_heads=6, num_kv_heads=3, head_dim=4)

    def moe(inter: int, shared: int) -> HybridConfig:
        ffn = MoE(num_experts=5, top_k=1, intermediate_size=inter, shared_intermediate_size=shared)
        return HybridConfig(vocab_size=VOCAB, hidden_size=32, layers=(
            Layer(mixer=attn, ffn=MLP(intermediate_size=15)), Layer(mixer=attn, ffn=ffn)))

    moe(21, 30).check_tensor_parallel(3)
    with pytest.raises(ValueError, match=r"layers\.1\.ffn: MoE\.intermediate_size=20 must be divisible by "
                                         r"tensor_parallel_size=3"):
        moe(20, 30).check_tensor_parallel(3)
    with pytest.raises(ValueError, match=r"layers\.1\.ffn: MoE\.shared_intermediate_size=32"):
        moe(21, 32).check_tensor_parallel(3)


def test_more_ranks_than_gpus_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 GPUs, this host has 1"):
        distributed.spawn_group(2, torch.device("cuda"), 5.0, print, ())
    with pytest.raises(ValueError, match="local rank 1 needs cuda:1"):
        distributed.rank_device(torch.device("cuda"), 1)


TIMEOUT = 4.0


@pytest.mark.parametrize("failure", ["killed", "killed_unnoticed", pytest.param("stuck", marks=pytest.mark.slow)])
def test_dead_or_stuck_rank_is_an_error_not_a_hang(failure: str) -> None:
    llm = LLM(MIXES["mamba2"](), tensor_parallel_size=2, distributed_timeout=TIMEOUT, **ENGINE_ARGS)
    try:
        batch = prompts(VOCAB, n=2)
        llm.generate(batch, GREEDY, use_tqdm=False)
        worker = llm._executor.ctx.processes[0]
        if failure == "stuck":
            os.kill(worker.pid, signal.SIGSTOP)              # alive, but never answers
        else:
            worker.kill()
            worker.join()
            if failure == "killed_unnoticed":               # let it fail inside a collective instead
                llm._executor.ctx.check_alive = lambda: None
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="tensor-parallel step failed"):
            llm.generate(batch, GREEDY, use_tqdm=False)
        assert time.monotonic() - start < TIMEOUT + 3
        with pytest.raises(TensorParallelError, match="failed earlier"):
            llm.generate(batch, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert worker.exitcode is not None


@pytest.mark.parametrize("action", ["exit", pytest.param("hang", marks=pytest.mark.slow)])
def test_a_rank_failing_inside_the_forward_is_an_error_not_a_hang(action: str, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    """Rank 1 takes its third step, runs the first half of the layers (their all-reduces complete), then exits
    or stops for good just before the middle layer: rank 0, blocked in that layer's all-reduce, raises at once
    (exit: the peer's sockets close) or at the timeout (hang), and refuses later steps."""
    monkeypatch.setattr(distributed, "WORKER_COMMAND", fault_command(1, 3, action))
    llm = LLM(MIXES["llama4_like"](), tensor_parallel_size=2, distributed_timeout=TIMEOUT, **ENGINE_ARGS)
    worker = llm._executor.ctx.processes[0]
    try:
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="tensor-parallel step failed") as info:
            llm.generate(prompts(VOCAB, n=2), GREEDY, use_tqdm=False)
        elapsed = time.monotonic() - start
        assert elapsed < (TIMEOUT + 3 if action == "hang" else 3), f"{elapsed:.1f}s: {info.value}"
        if action == "exit":                          # the error names the rank, not only the broken socket
            assert f"rank 1 (pid {worker.pid}) exited with code {EXIT_CODE}" in str(info.value)
        with pytest.raises(TensorParallelError, match="failed earlier"):
            llm.generate(prompts(VOCAB, n=1), GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert worker.exitcode == (EXIT_CODE if action == "exit" else -signal.SIGKILL)


class _Proc:
    def __init__(self, exitcode: int | None) -> None:
        self.pid, self.exitcode = 4242, exitcode


def test_bounded_step_wait_sees_a_dead_rank_or_the_timeout() -> None:
    """Rank 0's wait for a CUDA step (``ParallelContext.wait_for``, polled on the step's event): a spawned rank
    that exited is reported within milliseconds; with nothing to watch (torchrun) the timeout ends the wait."""
    ctx = ParallelContext(rank=0, size=2, device=torch.device("cpu"), tp=TensorParallel(), control=None,
                          timeout=0.5, processes=[_Proc(None)])
    polls = iter([False, False, True])
    ctx.wait_for(lambda: next(polls), "the step")                       # finishes normally
    ctx.processes = [_Proc(-9)]
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid 4242\) exited with code -9"):
        ctx.wait_for(lambda: False, "the step")
    assert time.monotonic() - start < 0.2
    ctx.processes = []
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"the step did not finish within distributed_timeout=0\.5s"):
        ctx.wait_for(lambda: False, "the step")
    assert 0.5 <= time.monotonic() - start < 1.5


_DRIVER_SCRIPT = """
import os, sys, time
sys.path.insert(0, {tests!r})
from _tp_fault_worker import fault_command
from _tp_helpers import ENGINE_ARGS, GREEDY, MIXES, VOCAB, prompts
from hybridkv import LLM
from hybridkv.engine import distributed

if __name__ == "__main__":
    distributed.WORKER_COMMAND = fault_command(1, 2, "hang")      # rank 1 stops inside its second forward
    llm = LLM(MIXES["llama4_like"](), tensor_parallel_size=2, distributed_timeout=120, **ENGINE_ARGS)
    print("RANK1", llm._executor.ctx.processes[0].pid, flush=True)
    llm.generate(prompts(VOCAB, n=2), GREEDY, use_tqdm=False)   # blocks in an all-reduce; the test kills us
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.slow    # a process spawned and torn down: the full suite runs it
def test_spawned_rank_exits_when_rank_0_dies_mid_step(tmp_path: Path) -> None:
    """Rank 0 is killed while rank 1 is stuck inside a forward (not waiting on any socket): rank 1's parent
    watcher ends it within about a second."""
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER_SCRIPT.format(tests=str(Path(__file__).parent)))
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    rank1 = None
    try:
        line = driver.stdout.readline()
        assert line.startswith("RANK1 "), line
        rank1 = int(line.split()[1])
        time.sleep(1.0)                                   # rank 1 reaches its stuck second step
        assert _alive(rank1)
        driver.kill()
        driver.wait()
        start = time.monotonic()
        while _alive(rank1) and time.monotonic() - start < 10:
            time.sleep(0.05)
        assert not _alive(rank1), "rank 1 outlived rank 0"
        assert time.monotonic() - start < 3
    finally:
        driver.kill()
        driver.wait()
        if rank1 is not None and _alive(rank1):
            os.kill(rank1, signal.SIGKILL)                # never leave a stuck rank behind


@pytest.mark.slow                   # ~14 s: the benchmark script end to end, not a sharding rule
def test_benchmark_smoke(tmp_path: Path) -> None:
    """benchmarks/tp_decode.py at tiny dims on the CPU: tp 1 vs tp 2 (identical in fp32), decode speed rows, and
    the in-forward failure case through the script's own harness."""
    script = Path(__file__).parent.parent / "benchmarks" / "tp_decode.py"
    out = tmp_path / "tp_decode_full.json"                   # the default (no --compare) path: tp 2 only
    done = subprocess.run([sys.executable, str(script), "--tiny", "--layers", "4", "--batches", "2", "--cases", "",
                           "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())["scenarios"]["compare"]       # (4 layers: not the full model)
    assert result["warmup"]["first_logits_finite"] and [r["batch"] for r in result["rows"]] == [2]
    assert result["meta"]["params_per_rank"] < result["meta"]["params"]
    out = tmp_path / "tp_decode.json"
    done = subprocess.run([sys.executable, str(script), "--tiny", "--layers", "4", "--compare", "--batches", "1,3",
                           "--cases", "died_in_forward", "--out", str(out)], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())["scenarios"]["compare"]
    assert result["correctness"]["tokens_identical_fraction"] == 1.0
    assert [(r["tp"], r["batch"]) for r in result["rows"]] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert all(r["decode_steps"] > 0 and r["tok_s"] > 0 for r in result["rows"])
    case = result["robustness"][0]
    assert not case["hung"] and [e["event"] for e in case["events"]][2:4] == ["raised", "second_call_raised"]
    assert "exited with code 13" in case["events"][2]["error"]
