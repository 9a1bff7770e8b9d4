"""The weight-loading framework: sharded and bf16 checkpoints, coverage accounting, and errors that name
the tensor (missing, unexpected, wrong shape, written twice, unknown target, unsupported architecture).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import _hf_models as hf_models
import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridkv.engine.model_runner import reference_logits
from hybridkv.loaders.checkpoint import load_hf_checkpoint
from hybridkv.loaders.weights import (
    Target,
    checkpoint_files,
    get_weight_map,
    load_weights,
    split_layer,
    supported_weight_architectures,
)
from hybridkv.models.config import MLP, Attention, HybridConfig, Layer, MoE
from hybridkv.models.hybrid import HybridModel

PROMPT = list(range(3, 40))


# -- a tiny native model and an identity-ish map, to test the framework by itself ----------------------
def _config(*, tied: bool = False) -> HybridConfig:
    attention = Attention(num_heads=2, num_kv_heads=1, head_dim=8)
    return HybridConfig(vocab_size=20, hidden_size=16, tie_word_embeddings=tied, layers=(
        Layer(mixer=attention, ffn=MLP(intermediate_size=24)),
        Layer(mixer=attention, ffn=MoE(num_experts=3, top_k=1, intermediate_size=8)),
    ))


def _hub_tensors(config: HybridConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Our parameters under hub-like names ("hub." prefix); experts stored one tensor per expert."""
    model = HybridModel(config)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        value = torch.randn(p.shape, generator=gen)
        if name.endswith(("gate_proj", "up_proj", "down_proj")) and p.ndim == 3:
            for e in range(p.shape[0]):
                out[f"hub.{name}.{e}"] = value[e].clone()
        else:
            out[f"hub.{name}"] = value
    return out


def _map(name: str, config: HybridConfig) -> list[Target] | None:
    if name == "hub.rotary.inv_freq":
        return []
    if not name.startswith("hub."):
        return None
    ours = name.removeprefix("hub.")
    head, _, last = ours.rpartition(".")
    if last.isdigit():
        return [Target(name=head, index=(int(last),))]
    return [Target(name=ours)]


def _write(tensors: dict[str, torch.Tensor], directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    return directory


def _empty(config: HybridConfig) -> HybridModel:
    model = HybridModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    return model


def test_loads_every_element_and_ignores_known_extras(tmp_path: Path) -> None:
    config = _config()
    tensors = _hub_tensors(config)
    tensors["hub.rotary.inv_freq"] = torch.ones(4)
    model = _empty(config)
    load_weights(model, _write(tensors, tmp_path), _map, config=config)
    params = dict(model.named_parameters())
    assert torch.equal(params["layers.1.ffn.up_proj"][2], tensors["hub.layers.1.ffn.up_proj.2"])
    assert torch.equal(params["layers.0.mixer.q_proj.weight"], tensors["hub.layers.0.mixer.q_proj.weight"])
    assert not any(p.isnan().any() for p in model.parameters())


def test_missing_parameter_and_partial_experts_are_named(tmp_path: Path) -> None:
    config = _config()
    tensors = _hub_tensors(config)
    del tensors["hub.layers.0.ffn.down_proj.weight"], tensors["hub.layers.1.ffn.gate_proj.1"]
    with pytest.raises(ValueError, match="not in the checkpoint") as err:
        load_weights(_empty(config), _write(tensors, tmp_path), _map, config=config)
    assert "layers.0.ffn.down_proj.weight" in str(err.value)
    assert "layers.1.ffn.gate_proj (256/384 elements)" in str(err.value)


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    config = _config()
    tensors = {**_hub_tensors(config), "vision.patch_embed.weight": torch.zeros(2, 2)}
    with pytest.raises(ValueError, match=r"1 unexpected checkpoint tensors: vision\.patch_embed\.weight"):
        load_weights(_empty(config), _write(tensors, tmp_path), _map, config=config)


def test_shape_mismatch_names_hub_tensor_and_target(tmp_path: Path) -> None:
    config = _config()
    tensors = _hub_tensors(config)
    tensors["hub.layers.1.ffn.down_proj.2"] = torch.zeros(8, 16)          # transposed
    with pytest.raises(ValueError, match=r"hub\.layers\.1\.ffn\.down_proj\.2 has shape \(8, 16\); "
                                         r"layers\.1\.ffn\.down_proj\[2\] expects \(16, 8\)"):
        load_weights(_empty(config), _write(tensors, tmp_path), _map, config=config)


def test_double_write_and_unknown_target_are_errors(tmp_path: Path) -> None:
    config = _config()
    tensors = _hub_tensors(config)

    def twice(name: str, cfg: HybridConfig) -> list[Target] | None:
        if name == "hub.layers.1.ffn.up_proj.0":      # also writes the whole stacked tensor
            return [Target(name="layers.1.ffn.up_proj", transform=lambda t: t.expand(3, 8, 16))]
        return _map(name, cfg)

    with pytest.raises(ValueError, match=r"writes layers\.1\.ffn\.up_proj(\[\d\])?, which an earlier tensor"):
        load_weights(_empty(config), _write(tensors, tmp_path / "a"), twice, config=config)

    def unknown(name: str, cfg: HybridConfig) -> list[Target] | None:
        return [Target(name="layers.9.nothing")] if name == "hub.norm.weight" else _map(name, cfg)

    with pytest.raises(ValueError, match=r"hub\.norm\.weight maps to layers\.9\.nothing, which is not a param"):
        load_weights(_empty(config), _write(tensors, tmp_path / "b"), unknown, config=config)


def test_tied_embeddings_need_no_lm_head_and_ignore_a_stored_copy(tmp_path: Path) -> None:
    config = _config(tied=True)
    tensors = _hub_tensors(config)
    assert "hub.lm_head.weight" not in tensors          # named_parameters lists the tied weight once
    model = _empty(config)
    load_weights(model, _write(tensors, tmp_path / "a"), _map, config=config)
    assert torch.equal(model.lm_head.weight, tensors["hub.embed_tokens.weight"])
    tensors["hub.lm_head.weight"] = torch.zeros(20, 16)   # a checkpoint that stores the tied copy too
    load_weights(model, _write(tensors, tmp_path / "b"), _map, config=config)
    assert torch.equal(model.lm_head.weight, tensors["hub.embed_tokens.weight"])


def test_checkpoint_without_safetensors_or_with_a_missing_shard(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        checkpoint_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        checkpoint_files(tmp_path)


def test_unsupported_architecture_lists_supported(tmp_path: Path) -> None:
    supported = supported_weight_architectures()
    assert {"Llama4ForCausalLM", "Llama4ForConditionalGeneration", "MistralForCausalLM", "Gemma2ForCausalLM",
            "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Mamba2ForCausalLM"} <= set(supported)
    with pytest.raises(ValueError, match="no weight loader for architecture 'GPT2LMHeadModel'; supported: "):
        get_weight_map("GPT2LMHeadModel")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_hf_checkpoint(tmp_path)


def test_split_layer() -> None:
    assert split_layer("layers.12.self_attn.q_proj.weight") == (12, "self_attn.q_proj.weight")
    assert split_layer("norm.weight") is None


# -- real HF checkpoints -----------------------------------------------------------------------------------
def _max_diff(model: HybridModel, hf: torch.nn.Module) -> float:
    return (reference_logits(model, PROMPT) - hf_models.full_logits(hf, PROMPT)).abs().max().item()


@pytest.mark.parametrize("family", ["llama4", "mistral"])
def test_sharded_checkpoint(family: str, tmp_path: Path) -> None:
    hf = hf_models.FAMILIES[family](0)
    hf_models.save(hf, tmp_path, max_shard_size="20KB")
    assert len(checkpoint_files(tmp_path)) > 3 and not (tmp_path / "model.safetensors").exists()
    model = load_hf_checkpoint(tmp_path, dtype=torch.float32)
    assert _max_diff(model, hf) <= 1e-4


def test_bf16_checkpoint_loads_as_fp32(tmp_path: Path) -> None:
    """The oracle is the fp32 HF model holding the bf16-rounded weights (``hf.to(bf16).float()`` would
    also round HF's RoPE frequency buffers, which a bf16 ``from_pretrained`` keeps in fp32)."""
    hf = hf_models.gemma3(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.bfloat16().float())
    hf_models.save(copy.deepcopy(hf).to(torch.bfloat16), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_file(str(tmp_path / "model.safetensors"))["model.norm.weight"].dtype == torch.bfloat16
    model = load_hf_checkpoint(tmp_path, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert torch.equal(model.embed_tokens.weight, hf.model.embed_tokens.weight)
    assert _max_diff(model, hf) <= 1e-4
    native = load_hf_checkpoint(tmp_path)                      # default: the checkpoint's dtype
    assert native.embed_tokens.weight.dtype == torch.bfloat16 and native.config.dtype == "bfloat16"
    assert native.layers[0].mixer.rotary.inv_freq.dtype == torch.float32     # built bare, but exact


def test_llama4_per_expert_layout(tmp_path: Path) -> None:
    """Re-exports that store experts one by one (``experts.{e}.gate_proj.weight``) load the same."""
    hf = hf_models.llama4(0)
    hf_models.save(hf, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("experts.gate_up_proj")]:
        base = name.removesuffix("gate_up_proj")
        gate, up = tensors.pop(name).chunk(2, dim=-1)
        down = tensors.pop(base + "down_proj")
        for e in range(gate.shape[0]):
            tensors[f"{base}{e}.gate_proj.weight"] = gate[e].t().contiguous()
            tensors[f"{base}{e}.up_proj.weight"] = up[e].t().contiguous()
            tensors[f"{base}{e}.down_proj.weight"] = down[e].t().contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert _max_diff(load_hf_checkpoint(tmp_path, dtype=torch.float32), hf) <= 1e-4


def test_gemma3_multimodal_in_memory_names(tmp_path: Path) -> None:
    """transformers 5.x's in-memory spelling (``model.language_model.``) is read as well as the hub's."""
    hf = hf_models.gemma3_multimodal(0)
    hf_models.save(hf, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    renamed = {k.replace("language_model.model.", "model.language_model.")
               .replace("vision_tower.", "model.vision_tower."): v for k, v in tensors.items()}
    assert any(k.startswith("model.language_model.") for k in renamed)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    assert _max_diff(load_hf_checkpoint(tmp_path, dtype=torch.float32), hf) <= 1e-4


def test_family_maps_reject_unknown_names() -> None:
    config = _config()
    for arch, name in [("Mamba2ForCausalLM", "backbone.layers.0.mixer.bogus"),
                       ("MistralForCausalLM", "model.layers.0.self_attn.rotary.weight"),
                       ("Llama4ForCausalLM", "model.layers.0.feed_forward.experts.x.gate_proj.weight"),
                       ("Gemma3ForConditionalGeneration", "lm_head.bias")]:
        assert get_weight_map(arch)(name, config) is None, (arch, name)
    assert get_weight_map("MistralForCausalLM")("model.layers.0.self_attn.rotary_emb.inv_freq", config) == []
