"""gpt-oss (``GptOssForCausalLM``): hub names of the released checkpoints and of ``save_pretrained``.

Attention: ``self_attn.{q,k,v,o}_proj.{weight,bias}`` and ``self_attn.sinks`` (one logit per head). The MoE:
``mlp.router.{weight,bias}`` and the experts, stored one of two ways:

- unquantized (``save_pretrained`` of a bf16 / fp32 model), laid out for ``x @ W``: ``gate_up_proj``
  (E, hidden, 2 * inter) with gate and up *interleaved* along the last dim (gate at even columns, up at odd),
  ``gate_up_proj_bias`` (E, 2 * inter) likewise, ``down_proj`` (E, inter, hidden), ``down_proj_bias`` (E, hidden);
- MXFP4 (the released openai/gpt-oss-20b and -120b): ``gate_up_proj_blocks`` / ``_scales`` and
  ``down_proj_blocks`` / ``_scales`` in (E, out, in) row order (``loaders/mxfp4.py``), the biases as above.

Ours are (E, out, in) with gate and up separate, so the interleave is undone by even/odd rows and the
unquantized weights are transposed. MXFP4 experts are decoded at load, one expert (and, for gate|up, one half)
at a time, into the model dtype: no packed-FP4 kernel yet, so they cost the dtype's bytes. In bf16 the expert
weights take 3 x 2880^2 x 2 B = 49.8 MB per expert: 38.2 GB for gpt-oss-20b (24 layers x 32 experts) and
229 GB for gpt-oss-120b (36 x 128), against ~4.25 bits per weight (~10.2 GB and ~61 GB) as MXFP4; the rest of
either model (attention, embeddings, head: 3.6 GB / 4.8 GB) is bf16 on the hub already.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridkv.loaders.families.mistral import LLAMA_ATTENTION, LLAMA_NORMS, decoder_map
from hybridkv.loaders.mxfp4 import dequantize_mxfp4
from hybridkv.loaders.weights import Target, register_weight_map, rename_module
from hybridkv.models.config import HybridConfig, MoE

_LAYER_MODULES = {**LLAMA_ATTENTION, **LLAMA_NORMS, "mlp.router": "ffn.router"}


Transform = Callable[..., torch.Tensor]


def _interleaved_weight(half: int) -> Transform:
    """(E, hidden, 2 * inter) -> (E, inter, hidden): the gate (half 0) or up (half 1) columns, as (out, in)."""
    return lambda w: w[..., half::2].transpose(-1, -2)


def _interleaved_bias(half: int) -> Transform:
    """(E, 2 * inter) -> (E, inter): the gate or up entries."""
    return lambda b: b[..., half::2]


def _mxfp4_expert(expert: int, half: int | None) -> Transform:
    """Expert ``expert``'s (out, in) weight from the blocks and scales of all experts; ``half``: only the gate (0)
    or up (1) rows of an interleaved gate|up."""
    def decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        b, s = blocks[expert], scales[expert]
        if half is not None:
            b, s = b[half::2], s[half::2]
        return dequantize_mxfp4(b, s)
    return decode


def _experts(i: int, rest: str, config: HybridConfig) -> list[Target] | None:
    """``mlp.experts.*`` of layer ``i`` (``rest`` without that prefix)."""
    ours = f"layers.{i}.ffn"
    hub = f"model.layers.{i}.mlp.experts"
    if rest == "gate_up_proj":
        return [Target(name=f"{ours}.gate_proj", transform=_interleaved_weight(0)),
                Target(name=f"{ours}.up_proj", transform=_interleaved_weight(1))]
    if rest == "gate_up_proj_bias":
        return [Target(name=f"{ours}.gate_bias", transform=_interleaved_bias(0)),
                Target(name=f"{ours}.up_bias", transform=_interleaved_bias(1))]
    if rest == "down_proj":
        return [Target(name=f"{ours}.down_proj", transform=lambda w: w.transpose(-1, -2))]
    if rest == "down_proj_bias":
        return [Target(name=f"{ours}.down_bias")]
    if rest in ("gate_up_proj_scales", "down_proj_scales"):
        return []                      # read with their blocks
    ffn = config.layers[i].ffn if i < len(config.layers) else None
    if rest not in ("gate_up_proj_blocks", "down_proj_blocks") or not isinstance(ffn, MoE):
        return None
    scales = (f"{hub}.{rest.removesuffix('_blocks')}_scales",)
    if rest == "down_proj_blocks":
        return [Target(name=f"{ours}.down_proj", index=(e,), transform=_mxfp4_expert(e, None), inputs=scales)
                for e in range(ffn.num_experts)]
    return [Target(name=f"{ours}.{part}_proj", index=(e,), transform=_mxfp4_expert(e, half), inputs=scales)
            for e in range(ffn.num_experts) for half, part in ((0, "gate"), (1, "up"))]


def _layer(i: int, rest: str, config: HybridConfig) -> list[Target] | None:
    if rest == "self_attn.sinks":
        return [Target(name=f"layers.{i}.mixer.sinks")]
    if rest.startswith("mlp.experts."):
        return _experts(i, rest.removeprefix("mlp.experts."), config)
    return rename_module(rest, _LAYER_MODULES, prefix=f"layers.{i}.")


gpt_oss = register_weight_map("GptOssForCausalLM")(decoder_map(layer=_layer))
