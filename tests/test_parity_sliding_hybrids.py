"""The sliding-window hybrids through the whole stack against HF transformers, in fp32:

- Cohere2 (Command-R7B): one bias-free LayerNorm feeding attention and MLP side by side, interleaved RoPE on the
  sliding layers only (the global layer NoPE), biased attention, ``logit_scale``;
- Exaone-4: post-norms only, q/k RMSNorms before RoPE, "LLLG" with the global layer NoPE;
- Granite-SWA: learned sinks, a RoPE base per layer (0: NoPE), µP multipliers;
- GraniteMoE-SWA: Granite-SWA's attention over 4 experts top-2 with the shared MLP beside them (without it, HF's
  default, the loaded model's forward is checked alone), read from the names ``save_pretrained`` writes and from
  GraniteMoE's hub spelling.

Each tiny random model (``tests/_hf_models.py``) is written by ``save_pretrained`` and loaded by ``LLM(path)`` with
4-token blocks and an 8-token step budget (prefills run in chunks): the same 32 greedy tokens as HF on a prompt
shorter than the window and on ones many windows long, per-step log-probabilities (sampled token and top 5) within
1e-4 of HF's full forward, with prefix caching on (a second pass over the same prompts and a prompt extending
another hit the cache, which the engine's counters show) and off (no hit). The HF oracle is an argmax loop over
full forwards (eager attention, no HF cache code involved).
"""

from __future__ import annotations

from pathlib import Path

import _hf_models as hf_models
import pytest
import torch
from _parity import (
    check_engine_matches_hf,
    check_prompt_logprobs,
    check_reference_forward,
    check_triton_graphs_match_hf,
    hf_checkpoint,
)
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from hybridkv.loaders.checkpoint import load_hf_checkpoint

NEW_TOKENS = 32
# family -> seed: greedy output stays diverse (no single-token attractor) for these prompts.
SEEDS = {"cohere2": 1, "exaone4": 0, "granite_swa": 0, "granitemoe_swa": 0}


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    base = [torch.randint(3, hf_models.VOCAB - 4, (n,), generator=gen).tolist() for n in (3, 37)]
    return base + [base[1] + torch.randint(3, hf_models.VOCAB - 4, (9,), generator=gen).tolist()]


# The quick tier (``-m "not slow"``) keeps Cohere2 (LayerNorm, parallel block) and GraniteMoE-SWA (Granite-SWA's
# sinks and RoPE bases under experts, ~2 s for its four tests); the others (~15 s each) are slow.
QUICK = ("cohere2", "granitemoe_swa")


@pytest.fixture(scope="module", params=[f if f in QUICK else pytest.param(f, marks=pytest.mark.slow) for f in SEEDS])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[str, PreTrainedModel, Path, dict]:
    """The family, the HF model, its checkpoint, and HF's greedy tokens and logits per prompt."""
    return hf_checkpoint(request.param, SEEDS[request.param], tmp_path_factory.mktemp(request.param), _prompts(),
                         new_tokens=NEW_TOKENS)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_engine_matches_hf(checkpoint: tuple[str, PreTrainedModel, Path, dict], prefix_caching: bool) -> None:
    name, _, path, expected = checkpoint
    check_engine_matches_hf(path, _prompts(), expected, new_tokens=NEW_TOKENS, prefix_caching=prefix_caching,
                            label=f"{name}: ")


def test_prompt_logprobs_match_hf(checkpoint: tuple[str, PreTrainedModel, Path, dict]) -> None:
    """Every prompt token's log-probability (a prefill's every row, through the chunked prefill)."""
    name, _, path, expected = checkpoint
    check_prompt_logprobs(path, _prompts()[1], expected, label=f"{name}: ")


def test_reference_forward_matches_hf(checkpoint: tuple[str, PreTrainedModel, Path, dict]) -> None:
    """The loaded model alone (one no-cache forward), independent of the engine."""
    name, hf, path, _ = checkpoint
    check_reference_forward(hf, path, _prompts(), label=f"{name}: ")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_backend_and_cuda_graphs_on_gpu_match_hf(checkpoint: tuple[str, PreTrainedModel, Path, dict]) -> None:
    """On CUDA with the triton backend (fused LayerNorm / post-norm adds, interleaved RoPE, sinks; fp32 attention in
    ieee precision): eager steps and decode steps captured as CUDA graphs, with prefix caching, both give HF's tokens
    and log-probabilities within 1e-4."""
    name, _, path, expected = checkpoint
    check_triton_graphs_match_hf(name, path, _prompts(), expected, new_tokens=NEW_TOKENS, graphs_capture=False)


def test_granitemoe_swa_without_shared_experts_matches_hf(tmp_path: Path) -> None:
    """HF's default ``shared_intermediate_size=0``: routed experts alone (no ``shared_mlp`` tensors to read)."""
    hf = hf_models.FAMILIES["granitemoe_swa_no_shared"](0)
    path = hf_models.save(hf, tmp_path)
    assert not any(".shared_mlp." in name for name in load_file(path / "model.safetensors"))
    check_reference_forward(hf, path, _prompts(), label="granitemoe_swa without shared experts: ")


# GraniteMoE's hub spelling of the experts and router (what GraniteMoE / GraniteMoeShared checkpoints hold).
_GRANITEMOE_HUB_NAMES = {"experts.gate_up_proj": "input_linear.weight", "experts.down_proj": "output_linear.weight",
                         "router.weight": "router.layer.weight"}


def test_granitemoe_swa_reads_granitemoe_hub_names(tmp_path: Path) -> None:
    """The experts and router under GraniteMoE's hub names load the same model as ``save_pretrained``'s names."""
    hf = hf_models.FAMILIES["granitemoe_swa"](0)
    saved = hf_models.save(hf, tmp_path / "saved")
    state = load_file(saved / "model.safetensors")
    renamed = {}
    for name, tensor in state.items():
        for ours, hub in _GRANITEMOE_HUB_NAMES.items():
            name = name.replace(f"block_sparse_moe.{ours}", f"block_sparse_moe.{hub}")
        renamed[name] = tensor
    assert len(set(renamed) - set(state)) == 3 * len(hf.model.layers)
    (tmp_path / "hub").mkdir()
    save_file(renamed, str(tmp_path / "hub" / "model.safetensors"))
    (tmp_path / "hub" / "config.json").write_text((saved / "config.json").read_text())
    model = load_hf_checkpoint(tmp_path / "hub", dtype=torch.float32, device="cpu")
    want = dict(load_hf_checkpoint(saved, dtype=torch.float32, device="cpu").named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, want[name]), name
    check_reference_forward(hf, tmp_path / "hub", _prompts()[1:2], label="granitemoe_swa, hub names: ")
