"""The generic hybrid decoder: every supported family is this model with a different ``HybridConfig``.

``forward(input_ids, positions)`` takes a flat batch of tokens (all requests of one step packed);
everything about the cache comes from the forward context, so the same forward serves prefill, decode,
chunked prefill and a no-cache reference run.

Zamba2's shared transformer blocks are owned once (``shared_blocks``) and borrowed by every use
(``layers.{i}.shared``), which keeps its own KV cache, adapters and output linear: the weights are saved,
loaded and moved exactly once, the caches are planned per use like any other attention layer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from hybridkv.layers.attention import AttentionLayer, AttentionUse
from hybridkv.layers.linear import LowRankAdapter
from hybridkv.layers.mamba1 import Mamba1Layer
from hybridkv.layers.mamba2 import Mamba2Layer
from hybridkv.layers.mlp import DenseMLP
from hybridkv.layers.moe import MoEFeedForward
from hybridkv.layers.norms import RMSNorm
from hybridkv.models.config import MLP, Attention, HybridConfig, Layer, Mamba1, Mamba2, MoE, SharedBlock

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


def _make_mixer(config: HybridConfig, mixer: object, cache_name: str) -> nn.Module:
    if isinstance(mixer, Attention):
        return AttentionLayer(config.hidden_size, mixer, cache_name=cache_name, norm_eps=config.norm_eps,
                              gemma_norm=config.norm == "gemma_rms")
    if isinstance(mixer, Mamba2):
        return Mamba2Layer(config.hidden_size, mixer, cache_name=cache_name)
    if isinstance(mixer, Mamba1):
        return Mamba1Layer(config.hidden_size, mixer, cache_name=cache_name)
    raise NotImplementedError(f"{cache_name}: mixer kind {type(mixer).__name__} is not built yet")


def _make_mlp(hidden_size: int, mlp: MLP) -> DenseMLP:
    return DenseMLP(hidden_size, mlp.intermediate_size, activation=mlp.activation, gated=mlp.gated,
                    bias=mlp.bias, gate_multiplier=mlp.gate_multiplier, down_multiplier=mlp.down_multiplier)


def _make_ffn(config: HybridConfig, ffn: object) -> nn.Module:
    if isinstance(ffn, MLP):
        return _make_mlp(config.hidden_size, ffn)
    assert isinstance(ffn, MoE)
    return MoEFeedForward(config.hidden_size, ffn)


def _norm(config: HybridConfig, dim: int | None = None) -> RMSNorm:
    return RMSNorm(dim or config.hidden_size, eps=config.norm_eps, gemma=config.norm == "gemma_rms")


def _normed(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` on the input cast to the norm's dtype: a no-op unless the residual stream is kept in
    fp32 (``residual_in_fp32``), where HF rounds to the model dtype before each norm too."""
    return norm(x.to(norm.weight.dtype))


class SharedTransformerBlock(nn.Module):
    """The weights of one Zamba2 shared block (``SharedBlock.block_id``): pre-norm, attention, pre-norm,
    MLP. Owned once by the model (``shared_blocks``); every use borrows them (``SharedBlockUse``)."""

    def __init__(self, config: HybridConfig, block: SharedBlock) -> None:
        super().__init__()
        hidden = config.hidden_size
        width = 2 * hidden if block.concat_embeddings else hidden
        self.input_norm = _norm(config, width)
        self.attention = AttentionLayer(width, block.attention, cache_name=f"shared_blocks.{block.block_id}",
                                        norm_eps=config.norm_eps, gemma_norm=config.norm == "gemma_rms",
                                        out_size=hidden)
        self.ffn_norm = _norm(config)
        self.mlp = _make_mlp(hidden, block.mlp)


class SharedBlockUse(nn.Module):
    """One use of a shared block at a layer: its own KV cache and adapters, the block's weights, and the
    layer's output ``linear``: ``linear(mlp(norm2(attention(norm1(concat(x, embeddings))))))``."""

    def __init__(self, config: HybridConfig, spec: SharedBlock, block: SharedTransformerBlock,
                 cache_name: str) -> None:
        super().__init__()
        hidden, rank = config.hidden_size, spec.adapter_rank
        self._block = (block,)      # borrowed, not registered: the weights have one owner
        self.concat_embeddings = spec.concat_embeddings
        self.attention = AttentionUse(block.attention, cache_name=cache_name,
                                      adapter_rank=rank if spec.attention_adapters else 0)
        self.mlp_adapter = LowRankAdapter(hidden, rank, 2 * spec.mlp.intermediate_size) if rank else None
        self.linear = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x, embeddings: (num_tokens, hidden_size) -> (num_tokens, hidden_size); no residual inside
        block = self._block[0]
        h = torch.cat([x, embeddings.to(x.dtype)], dim=-1) if self.concat_embeddings else x
        h = _normed(block.ffn_norm, self.attention(_normed(block.input_norm, h), positions))
        h = block.mlp(h, self.mlp_adapter(h) if self.mlp_adapter is not None else None)
        return self.linear(h)


class DecoderLayer(nn.Module):
    """``h = x + m * mixer(norm(x)); out = h + m * ffn(norm(h))`` (m: residual multiplier), with the
    Gemma post-norms when ``sandwich_norm``, a parallel mixer summed with the mixer, and a shared block
    whose output t feeds the mixer: ``h = x + m * mixer(norm(x + t))``."""

    def __init__(self, config: HybridConfig, layer: Layer, index: int,
                 shared_blocks: Mapping[str, SharedTransformerBlock]) -> None:
        super().__init__()
        self.residual_multiplier = config.residual_multiplier
        self.shared = (
            SharedBlockUse(config, layer.shared_block, shared_blocks[str(layer.shared_block.block_id)],
                           config.layer_cache_name(index, shared=True))
            if layer.shared_block is not None else None)
        self.input_norm = _norm(config) if layer.mixer is not None else None
        self.mixer = _make_mixer(config, layer.mixer, config.layer_cache_name(index)) if layer.mixer else None
        self.parallel_mixer = (
            _make_mixer(config, layer.parallel_mixer, config.layer_cache_name(index, parallel=True))
            if layer.parallel_mixer is not None else None)
        self.post_mixer_norm = _norm(config) if layer.sandwich_norm and layer.mixer is not None else None
        self.ffn_norm = _norm(config) if layer.ffn is not None else None
        self.ffn = _make_ffn(config, layer.ffn) if layer.ffn is not None else None
        self.post_ffn_norm = _norm(config) if layer.sandwich_norm and layer.ffn is not None else None

    def cache_modules(self) -> list[nn.Module]:
        """The modules of this layer that own a cache, in execution order."""
        shared = [self.shared.attention] if self.shared is not None else []
        return shared + [m for m in (self.mixer, self.parallel_mixer) if m is not None]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, hidden_size) residual stream; embeddings: the model's input embeddings
        if self.mixer is not None:
            h = x + self.shared(x, embeddings, positions) if self.shared is not None else x
            h = _normed(self.input_norm, h)
            out = self.mixer(h, positions)
            if self.parallel_mixer is not None:
                out = out + self.parallel_mixer(h, positions)
            if self.post_mixer_norm is not None:
                out = self.post_mixer_norm(out)
            x = x + out * self.residual_multiplier
        if self.ffn is not None:
            out = self.ffn(_normed(self.ffn_norm, x))
            if self.post_ffn_norm is not None:
                out = self.post_ffn_norm(out)
            x = x + out * self.residual_multiplier
        return x


class HybridModel(nn.Module):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        blocks = {str(layer.shared_block.block_id): layer.shared_block
                  for layer in config.layers if layer.shared_block is not None}
        self.shared_blocks = nn.ModuleDict({b: SharedTransformerBlock(config, spec)
                                            for b, spec in blocks.items()})   # Zamba2 weights, one copy
        self.layers = nn.ModuleList(DecoderLayer(config, layer, i, self.shared_blocks)
                                    for i, layer in enumerate(config.layers))
        self.norm = _norm(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def cache_layers(self) -> dict[str, nn.Module]:
        """Cache name -> the module that owns that cache (for binding KV / state tensors)."""
        return {m.cache_name: m for layer in self.layers for m in layer.cache_modules()}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: (num_tokens,) -> hidden states (num_tokens, hidden_size)
        x = self.embed_tokens(input_ids)
        if self.config.embedding_multiplier != 1.0:
            # Gemma multiplies by sqrt(hidden) rounded to the model dtype; do the same.
            x = x * torch.tensor(self.config.embedding_multiplier, dtype=x.dtype)
        embeddings = x
        if self.config.residual_in_fp32:
            x = x.float()
        for layer in self.layers:
            x = layer(x, positions, embeddings)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(num_tokens, hidden_size) -> fp32 logits (num_tokens, vocab_size)."""
        logits = self.lm_head(hidden.to(self.lm_head.weight.dtype)).float()
        if self.config.logits_multiplier != 1.0:
            logits = logits * self.config.logits_multiplier
        cap = self.config.final_softcap
        return cap * torch.tanh(logits / cap) if cap is not None else logits


def _init_weights(model: HybridModel, seed: int) -> None:
    """Deterministic small random init (std 0.02 linears/embeddings; norms at identity; Mamba A/dt
    as in Mamba2's own init) so random-init models are numerically well behaved."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("A_log"):    # (heads,) for Mamba2, (channels, state) for Mamba-1
                p.copy_(torch.log(torch.linspace(1, 16, p.shape[-1])).expand_as(p))
            elif name.endswith("dt_bias"):
                dt = torch.exp(torch.rand(p.shape, generator=gen) * (math.log(0.1) - math.log(1e-3))
                               + math.log(1e-3))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif name.endswith(".D"):
                p.fill_(1.0)
            elif p.ndim == 1:
                zero = "bias" in name or ("norm" in name and model.config.norm == "gemma_rms")
                p.fill_(0.0 if zero else 1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def build_model(config: HybridConfig, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                seed: int = 0) -> HybridModel:
    """A model with deterministic random weights (same seed -> same weights on every device)."""
    model = HybridModel(config)
    _init_weights(model, seed)
    return model.to(device=device, dtype=dtype or config.torch_dtype).eval()


def save_model(model: HybridModel, directory: str | Path) -> None:
    """``config.json`` (the HybridConfig) + ``model.safetensors`` (tied weights stored once)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).write_text(json.dumps(model.config.to_dict(), indent=1))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(directory / WEIGHTS_NAME))


def load_model(directory: str | Path, *, dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu") -> HybridModel:
    """Load a model saved by ``save_model``; missing or unexpected tensors are errors naming them."""
    directory = Path(directory)
    config = HybridConfig.from_dict(json.loads((directory / CONFIG_NAME).read_text()))
    model = HybridModel(config)
    state = load_file(str(directory / WEIGHTS_NAME))
    expected = set(model.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"{directory / WEIGHTS_NAME}: missing tensors {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    params = model.state_dict()
    for name, tensor in state.items():
        if params[name].shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model "
                             f"{tuple(params[name].shape)}")
    model.load_state_dict(state, strict=False)
    return model.to(device=device, dtype=dtype or config.torch_dtype).eval()
