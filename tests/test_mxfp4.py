"""MXFP4 expert weights (the released gpt-oss checkpoints' ``*_blocks`` / ``*_scales``): the decoder against
transformers' own ``convert_moe_packed_tensors`` on random data, and a tiny gpt-oss checkpoint stored as MXFP4
loaded through the weight map against the HF model running transformers' dequantization of the same bytes."""

from __future__ import annotations

import json
from pathlib import Path

import _hf_models as hf_models
import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridkv.engine.model_runner import reference_logits
from hybridkv.loaders.checkpoint import load_hf_checkpoint
from hybridkv.loaders.mxfp4 import dequantize_mxfp4

convert = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors


def _packed(shape: tuple[int, ...], groups: int, low: int, high: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks (*shape, groups, 16) and scales (*shape, groups) with exponents in [low, high)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, groups, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(low, high, (*shape, groups), dtype=torch.uint8, generator=g)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "groups", "low", "high"), [
    ((3, 10), 4, 110, 140),           # (experts, rows): the checkpoint's layout
    ((2, 7), 1, 0, 256),              # every exponent, subnormal to huge
    ((5, 96), 90, 120, 128),          # gpt-oss's 2880-wide rows (90 blocks)
])
def test_dequantize_matches_transformers(shape, groups, low, high, dtype) -> None:
    """transformers returns (E, in, out) (its x @ W layout); ours is (E, out, in) (rows as stored)."""
    blocks, scales = _packed(shape, groups, low, high, seed=groups)
    ours = dequantize_mxfp4(blocks, scales, dtype=dtype)
    assert ours.shape == (*shape, groups * 32) and ours.dtype == dtype
    assert torch.equal(ours.transpose(1, 2), convert(blocks, scales, dtype=dtype))


def test_dequantize_values_and_nibble_order() -> None:
    """Byte 0x_lo_hi: the low nibble is the first value; scale 128 doubles every value."""
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x72                  # low nibble 2 (+1.0), high nibble 7 (+6.0)
    blocks[0, 0, 1] = 0x9F                  # low nibble 15 (-6.0), high nibble 9 (-0.5)
    out = dequantize_mxfp4(blocks, torch.full((1, 1), 128, dtype=torch.uint8))
    assert out[0, :4].tolist() == [2.0, 12.0, -12.0, -1.0] and out.shape == (1, 32)


def test_dequantize_bad_input_and_meta() -> None:
    blocks, scales = _packed((2, 3), 2, 120, 130, seed=0)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.float(), scales)
    with pytest.raises(ValueError, match=r"expected blocks \(\.\.\., G, 16\)"):
        dequantize_mxfp4(blocks, scales[..., :1])
    meta = dequantize_mxfp4(blocks.to("meta"), scales.to("meta"))
    assert meta.is_meta and meta.shape == (2, 3, 64)


def _mxfp4_checkpoint(directory: Path) -> torch.nn.Module:
    """A tiny gpt-oss whose experts are random MXFP4: the checkpoint stores the blocks and scales (the released
    names, (E, out, in / 32, 16) and (E, out, in / 32)) and the config the released quantization_config; the HF
    model holds transformers' dequantization of them, as its MXFP4 loader does."""
    hf = hf_models.gpt_oss(0)
    hf_models.save(hf, directory)
    tensors = load_file(directory / "model.safetensors")
    for i, layer in enumerate(hf.model.layers):
        experts = layer.mlp.experts
        for name, param, exponents in (("gate_up_proj", experts.gate_up_proj, (121, 124)),
                                       ("down_proj", experts.down_proj, (122, 125))):
            experts_n, inputs, outputs = param.shape                       # HF: (E, in, out)
            blocks, scales = _packed((experts_n, outputs), inputs // 32, *exponents, seed=10 * i + len(name))
            with torch.no_grad():
                param.copy_(convert(blocks, scales, dtype=torch.float32))
            prefix = f"model.layers.{i}.mlp.experts.{name}"
            del tensors[prefix]
            tensors[f"{prefix}_blocks"], tensors[f"{prefix}_scales"] = blocks, scales
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"],
                                     "quant_method": "mxfp4"}
    (directory / "config.json").write_text(json.dumps(config))
    return hf


def test_mxfp4_checkpoint_matches_hf(tmp_path: Path) -> None:
    hf = _mxfp4_checkpoint(tmp_path)
    model = load_hf_checkpoint(tmp_path, dtype=torch.float32)
    prompt = torch.randint(3, hf_models.VOCAB - 4, (29,), generator=torch.Generator().manual_seed(5)).tolist()
    diff = (reference_logits(model, prompt) - hf_models.full_logits(hf, prompt)).abs().max().item()
    assert diff <= 1e-4, diff
    # the gate and up halves of the interleaved rows went to their own parameters
    blocks = load_file(tmp_path / "model.safetensors")
    gate_up = dequantize_mxfp4(blocks["model.layers.1.mlp.experts.gate_up_proj_blocks"],
                               blocks["model.layers.1.mlp.experts.gate_up_proj_scales"])
    assert torch.equal(model.layers[1].ffn.gate_proj.data, gate_up[:, 0::2])
    assert torch.equal(model.layers[1].ffn.up_proj.data, gate_up[:, 1::2])


def test_mxfp4_checkpoint_errors_name_the_tensors(tmp_path: Path) -> None:
    _mxfp4_checkpoint(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    scales = tensors.pop("model.layers.2.mlp.experts.down_proj_scales")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj_blocks .*needs model.layers.2.mlp.experts.down_proj_scales"):
        load_hf_checkpoint(tmp_path, dtype=torch.float32)
    tensors["model.layers.2.mlp.experts.down_proj_scales"] = scales[:, :, :0]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"down_proj_blocks -> layers.2.ffn.down_proj\[0\]: MXFP4 blocks"):
        load_hf_checkpoint(tmp_path, dtype=torch.float32)
