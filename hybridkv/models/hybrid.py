"""The generic hybrid decoder: every supported family is this model with a different ``HybridConfig``.

``forward(input_ids, positions)`` takes a flat batch of tokens (all requests of one step packed);
everything about the cache comes from the forward context, so the same forward serves prefill, decode,
chunked prefill and a no-cache reference run.

Zamba2's shared transformer blocks are owned once (``shared_blocks``) and borrowed by every use
(``layers.{i}.shared``), which keeps its own KV cache, adapters and output linear: the weights are saved,
loaded and moved exactly once, the caches are planned per use like any other attention layer.
"""

from __future__ import annotations

import contextlib
import json
import math
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.overrides import TorchFunctionMode

from hybridkv.backends.registry import KernelBackend
from hybridkv.forward_context import current_ops
from hybridkv.layers.activations import get_activation
from hybridkv.layers.altup import AltUp, Laurel, collapse_streams, expand_streams
from hybridkv.layers.attention import AttentionLayer, AttentionUse
from hybridkv.layers.kind import MixerConfig
from hybridkv.layers.linear import LowRankAdapter, ParallelLMHead, VocabParallelEmbedding
from hybridkv.layers.mlp import DenseMLP
from hybridkv.layers.moe import DenseMoEFeedForward, MoEFeedForward
from hybridkv.layers.norms import RMSNorm
from hybridkv.layers.parallel import SINGLE, Shard, Split, TensorParallel, shard_rules
from hybridkv.models.config import MLP, DenseMoE, HybridConfig, Layer, MoE, SharedBlock
from hybridkv.models.memory import check_device, check_fits, parameter_lower_bound
from hybridkv.models.safetensors_file import CheckpointError, TensorReader, read_header

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


def _make_mixer(config: HybridConfig, mixer: MixerConfig, cache_name: str, tp: TensorParallel) -> nn.Module:
    return mixer.build(config.hidden_size, cache_name=cache_name, tp=tp, model_config=config)


def _make_mlp(hidden_size: int, mlp: MLP, tp: TensorParallel) -> DenseMLP:
    return DenseMLP(hidden_size, mlp.intermediate_size, activation=mlp.activation, gated=mlp.gated,
                    bias=mlp.bias, gate_multiplier=mlp.gate_multiplier, down_multiplier=mlp.down_multiplier, tp=tp,
                    activation_sparsity=mlp.activation_sparsity)


def _make_ffn(config: HybridConfig, ffn: object, tp: TensorParallel) -> nn.Module:
    if isinstance(ffn, MLP):
        return _make_mlp(config.hidden_size, ffn, tp)
    if isinstance(ffn, DenseMoE):
        return DenseMoEFeedForward(config.hidden_size, _make_mlp(config.hidden_size, ffn.mlp, tp), ffn.moe,
                                   norm_eps=config.norm_eps, gemma_norm=config.norm == "gemma_rms", tp=tp)
    assert isinstance(ffn, MoE)
    return MoEFeedForward(config.hidden_size, ffn, tp=tp)


def _per_layer_activation(config: HybridConfig, layer: Layer) -> str:
    """The activation of a per-layer input's gate: its layer's feed-forward's, else the model's first one's."""
    ffn = layer.ffn or next(layer.ffn for layer in config.layers if layer.ffn is not None)
    return ffn.activation


def _norm(config: HybridConfig, dim: int | None = None) -> RMSNorm:
    return RMSNorm(dim or config.hidden_size, eps=config.norm_eps, gemma=config.norm == "gemma_rms",
                   centered=config.norm == "layer")


def _normed(norm: RMSNorm | None, x: torch.Tensor, ops: KernelBackend | None = None) -> torch.Tensor:
    """``norm(x)`` on the input cast to the norm's dtype: a no-op unless the residual stream is kept in
    fp32 (``residual_in_fp32``), where HF rounds to the model dtype before each norm too. With ``ops``, the
    backend's ``rms_norm`` runs it (one fused kernel on triton). No norm (a post-norm-only layer): x."""
    if norm is None:
        return x
    x = x.to(norm.weight.dtype)
    if ops is None:
        return norm(x)
    return ops.rms_norm(x, norm.weight, eps=norm.eps, gemma=norm.gemma, centered=norm.centered)


class SharedTransformerBlock(nn.Module):
    """The weights of one Zamba2 shared block (``SharedBlock.block_id``): pre-norm, attention, pre-norm,
    MLP. Owned once by the model (``shared_blocks``); every use borrows them (``SharedBlockUse``)."""

    def __init__(self, config: HybridConfig, block: SharedBlock, *, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        hidden = config.hidden_size
        width = 2 * hidden if block.concat_embeddings else hidden
        self.input_norm = _norm(config, width)
        self.attention = AttentionLayer(width, block.attention, cache_name=f"shared_blocks.{block.block_id}",
                                        norm_eps=config.norm_eps, gemma_norm=config.norm == "gemma_rms",
                                        out_size=hidden, tp=tp)
        self.ffn_norm = _norm(config)
        self.mlp = _make_mlp(hidden, block.mlp, tp)


class SharedBlockUse(nn.Module):
    """One use of a shared block at a layer: its own KV cache and adapters, the block's weights, and the
    layer's output ``linear``: ``linear(mlp(norm2(attention(norm1(concat(x, embeddings))))))``."""

    def __init__(self, config: HybridConfig, spec: SharedBlock, block: SharedTransformerBlock,
                 cache_name: str, *, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        hidden, rank, inter = config.hidden_size, spec.adapter_rank, spec.mlp.intermediate_size
        self._block = (block,)      # borrowed, not registered: the weights have one owner
        self.concat_embeddings = spec.concat_embeddings
        self.attention = AttentionUse(block.attention, cache_name=cache_name,
                                      adapter_rank=rank if spec.attention_adapters else 0)
        gate_up = Split(inter, inter, what="SharedBlock.mlp.intermediate_size")     # split like gate|up
        self.mlp_adapter = (LowRankAdapter(hidden, rank, 2 * inter, tp=tp, sections=(gate_up, gate_up))
                            if rank else None)
        self.linear = nn.Linear(hidden, hidden, bias=False)          # replicated: hidden -> hidden

    def forward(self, x: torch.Tensor, embeddings: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x, embeddings: (num_tokens, hidden_size) -> (num_tokens, hidden_size); no residual inside
        block = self._block[0]
        h = torch.cat([x, embeddings.to(x.dtype)], dim=-1) if self.concat_embeddings else x
        h = _normed(block.ffn_norm, self.attention(_normed(block.input_norm, h), positions))
        h = block.mlp(h, self.mlp_adapter(h) if self.mlp_adapter is not None else None)
        return self.linear(h)


class PerLayerInput(nn.Module):
    """Gemma-3n / Gemma-4's per-layer input, added after a layer's feed-forward: ``post_norm(projection(act(gate(x))
    * input))`` with ``input`` this layer's (num_tokens, P) slice of the model's per-layer inputs. Replicated under
    tensor parallelism (P is small)."""

    def __init__(self, config: HybridConfig, activation: str) -> None:
        super().__init__()
        size = config.per_layer_input_size
        self.act = get_activation(activation)
        self.gate = nn.Linear(config.hidden_size, size, bias=False)
        self.projection = nn.Linear(size, config.hidden_size, bias=False)
        self.post_norm = _norm(config)

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, hidden), per_layer_input: (num_tokens, P) -> (num_tokens, hidden), before post_norm
        return self.projection(self.act(self.gate(x)) * per_layer_input)


class DecoderLayer(nn.Module):
    """``h = x + m * mixer(norm(x)); out = h + m * ffn(norm(h))`` (m: residual multiplier), with the
    Gemma post-norms when ``sandwich_norm`` (and no pre-norms without ``pre_norm``), a parallel mixer summed
    with the mixer, a parallel feed-forward (``out = x + m * (mixer(n) + ffn(n))``, n = norm(x)), and a shared
    block whose output t feeds the mixer: ``h = x + m * mixer(norm(x + t))``."""

    def __init__(self, config: HybridConfig, layer: Layer, index: int,
                 shared_blocks: Mapping[str, SharedTransformerBlock], *, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.residual_multiplier = config.residual_multiplier
        self.shared = (
            SharedBlockUse(config, layer.shared_block, shared_blocks[str(layer.shared_block.block_id)],
                           config.layer_cache_name(index, shared=True), tp=tp)
            if layer.shared_block is not None else None)
        self.parallel_ffn = layer.parallel_ffn
        self.input_norm = _norm(config) if layer.mixer is not None and layer.pre_norm else None
        self.mixer = (_make_mixer(config, layer.mixer, config.layer_cache_name(index), tp)
                      if layer.mixer else None)
        self.parallel_mixer = (
            _make_mixer(config, layer.parallel_mixer, config.layer_cache_name(index, parallel=True), tp)
            if layer.parallel_mixer is not None else None)
        self.post_mixer_norm = _norm(config) if layer.sandwich_norm and layer.mixer is not None else None
        self.ffn_norm = (_norm(config) if layer.ffn is not None and layer.pre_norm and not layer.parallel_ffn
                         else None)
        self.ffn = _make_ffn(config, layer.ffn, tp) if layer.ffn is not None else None
        self.post_ffn_norm = _norm(config) if layer.sandwich_norm and layer.ffn is not None else None
        self.per_layer = (PerLayerInput(config, _per_layer_activation(config, layer))
                          if config.per_layer_input_size else None)
        self.layer_scalar = nn.Parameter(torch.ones(1)) if config.layer_scalar else None
        self.altup = AltUp(config.hidden_size, config.altup, eps=config.norm_eps) if config.altup else None
        self.laurel = (Laurel(config.hidden_size, config.laurel_rank, eps=config.norm_eps)
                       if config.laurel_rank else None)

    def cache_modules(self) -> list[nn.Module]:
        """The modules of this layer that own a cache, in execution order."""
        shared = [self.shared.attention] if self.shared is not None else []
        return shared + [m for m in (self.mixer, self.parallel_mixer) if m is not None]

    def entry_norm(self) -> RMSNorm | None:
        """The norm this layer first applies to its incoming residual stream, which the previous layer's last
        residual add computes in the same kernel (``forward``'s ``normed``). None with a shared block, whose
        output joins the stream before that norm, and without pre-norms."""
        if self.shared is not None:
            return None
        return self.input_norm if self.mixer is not None else self.ffn_norm

    def forward(self, x: torch.Tensor, positions: torch.Tensor, embeddings: torch.Tensor, *,
                normed: torch.Tensor | None = None, next_norm: RMSNorm | None = None,
                per_layer_input: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: (num_tokens, hidden_size) residual stream; embeddings: the model's input embeddings; normed:
        ``entry_norm()(x)`` when the caller has it; per_layer_input: (num_tokens, P), this layer's per-layer input.
        Returns (the new residual stream, ``next_norm`` of it or None): each residual add runs with the branch's
        post-norm and the next pre-norm as one backend op, across layers too, so a layer costs no launch of its own
        for its input norm (a layer with a per-layer input or scalar applies the next norm after those)."""
        ops = current_ops()
        tail = self.per_layer is not None or self.layer_scalar is not None
        final_norm, next_norm = next_norm, (None if tail else next_norm)
        if self.mixer is not None:
            if self.shared is not None:
                x_in = x + self.shared(x, embeddings, positions)
                normed = _normed(self.input_norm, x_in, ops)
            elif normed is None:
                normed = _normed(self.input_norm, x, ops)
            out = self.mixer(normed, positions)
            if self.parallel_mixer is not None:
                out = out + self.parallel_mixer(normed, positions)
            if self.parallel_ffn:       # HF adds (x + attn) + mlp; one add of attn + mlp saves a launch
                out = out + self.ffn(normed)
            after = self.ffn_norm if self.ffn is not None and not self.parallel_ffn else next_norm
            normed, x = ops.add_rms_norm(out, x, **self._add_norm(self.post_mixer_norm, after))
        if self.ffn is not None and not self.parallel_ffn:
            if normed is None:
                normed = _normed(self.ffn_norm, x, ops)
            out = self.ffn(normed, x) if isinstance(self.ffn, DenseMoEFeedForward) else self.ffn(normed)
            normed, x = ops.add_rms_norm(out, x, **self._add_norm(self.post_ffn_norm, next_norm))
        if tail:
            if self.per_layer is not None:
                post = self.per_layer.post_norm
                _, x = ops.add_rms_norm(self.per_layer(x, per_layer_input), x, weight=None, eps=post.eps,
                                        gemma=post.gemma, centered=post.centered, delta_weight=post.weight)
            if self.layer_scalar is not None:
                x = x * self.layer_scalar.to(x.dtype)
            return x, (_normed(final_norm, x, ops) if final_norm is not None else None)
        if next_norm is not None and normed is None:    # a layer with neither branch (config allows none)
            normed = _normed(next_norm, x, ops)
        return x, normed

    def forward_altup(self, streams: torch.Tensor, positions: torch.Tensor,
                      per_layer_input: torch.Tensor | None) -> torch.Tensor:
        """Gemma-3n's layer (HF ``Gemma3nTextDecoderLayer``) on (streams, num_tokens, hidden) -> the same shape:
        predict, the sandwich-normed attention (with Laurel beside it) and MLP on the active prediction, correct,
        then the per-layer input into streams 1 onwards."""
        ops = current_ops()
        altup = self.altup
        predictions = altup.predict(streams)
        active = predictions[altup.active]
        normed = _normed(self.input_norm, active, ops)
        h = active + _normed(self.post_mixer_norm, self.mixer(normed, positions), ops)
        if self.laurel is not None:
            h = (h + self.laurel(normed)) / math.sqrt(2)
        out = self.ffn(_normed(self.ffn_norm, h, ops))
        corrected = altup.correct(predictions, h + _normed(self.post_ffn_norm, out, ops))
        if self.per_layer is not None:
            first = altup.scale_corrected(corrected[altup.active])
            corrected[1:] += self.per_layer.post_norm(self.per_layer(first, per_layer_input))   # HF: streams 1..
        return corrected

    def _add_norm(self, post: RMSNorm | None, nxt: RMSNorm | None) -> dict:
        """``add_rms_norm`` arguments: the branch's post-norm, the next pre-norm, the residual multiplier."""
        norm = next((n for n in (post, nxt, self.input_norm, self.ffn_norm) if n is not None), None)
        if norm is None:            # a residual add with no norm around it
            return dict(weight=None, eps=1e-6, delta_weight=None, scale=self.residual_multiplier)
        return dict(weight=nxt.weight if nxt is not None else None, eps=norm.eps, gemma=norm.gemma,
                    centered=norm.centered, delta_weight=post.weight if post is not None else None,
                    scale=self.residual_multiplier)


class HybridModel(nn.Module):
    """``tp``: this process's rank in a tensor-parallel group; the model then holds that rank's shard of
    every split parameter (``parameter_shards``) and its forward runs the group's collectives. The residual
    stream, norms and routers are replicated; ``compute_logits`` returns the full logits on rank 0 only."""

    def __init__(self, config: HybridConfig, *, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if tp.size > 1:
            config.check_tensor_parallel(tp.size)       # one clear error naming the layer and dimension
        self.config = config
        self.tp = tp
        self._shards: dict[str, Shard] | None = None
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        blocks = {str(layer.shared_block.block_id): layer.shared_block
                  for layer in config.layers if layer.shared_block is not None}
        self.shared_blocks = nn.ModuleDict({b: SharedTransformerBlock(config, spec, tp=tp)
                                            for b, spec in blocks.items()})   # Zamba2 weights, one copy
        self.layers = nn.ModuleList(DecoderLayer(config, layer, i, self.shared_blocks, tp=tp)
                                    for i, layer in enumerate(config.layers))
        self.norm = _norm(config)
        if config.per_layer_input_size:     # Gemma-3n / Gemma-4 per-layer inputs (``HybridConfig``), replicated
            width = len(config.layers) * config.per_layer_input_size
            self.embed_tokens_per_layer = nn.Embedding(config.per_layer_vocab_size or config.vocab_size, width)
            self.per_layer_model_projection = nn.Linear(config.hidden_size, width, bias=False)
            self.per_layer_projection_norm = _norm(config, config.per_layer_input_size)
        if config.altup is not None:        # Gemma-3n: embeddings -> streams 1.. and back (``AltUp``), replicated
            def projections() -> nn.ModuleList:
                return nn.ModuleList(nn.Linear(config.hidden_size, config.hidden_size, bias=False)
                                     for _ in range(config.altup.num_inputs - 1))
            self.altup_projections, self.altup_unembed_projections = projections(), projections()
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp=tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def parameter_shards(self) -> dict[str, Shard]:
        """Parameter name -> how its full tensor splits over the ranks (absent: replicated)."""
        if self._shards is None:
            self._shards = shard_rules(self)
        return self._shards

    def shard_of(self, name: str, full: torch.Tensor, *, offset: int = 0) -> torch.Tensor:
        """This rank's part of the full tensor of parameter ``name`` (the tensor itself when replicated or
        at tp 1). Loaders call this on every full tensor they produce."""
        shard = self.parameter_shards().get(name) if self.tp.size > 1 else None
        return shard.take(full, self.tp, offset=offset) if shard is not None else full

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
        # Each layer's last residual add also applies the next layer's input norm (``DecoderLayer.forward``)
        # and the last one the final norm, unless the stream is fp32: HF's final norm reads it unrounded.
        layers = list(self.layers)
        final = None if self.config.residual_in_fp32 else self.norm
        next_norms = [layer.entry_norm() for layer in layers[1:]] + [final] if layers else []
        per_layer = self._per_layer_inputs(input_ids, embeddings) if self.config.per_layer_input_size else None
        if self.config.altup is not None:
            streams = expand_streams(x, self.altup_projections)          # (streams, num_tokens, hidden)
            for i, layer in enumerate(layers):
                streams = layer.forward_altup(streams, positions, per_layer[:, i] if per_layer is not None else None)
            x = collapse_streams(streams, self.altup_unembed_projections)
            return current_ops().rms_norm(x, self.norm.weight, eps=self.norm.eps, gemma=self.norm.gemma,
                                          centered=self.norm.centered)
        normed = None
        for i, (layer, next_norm) in enumerate(zip(layers, next_norms, strict=True)):
            x, normed = layer(x, positions, embeddings, normed=normed, next_norm=next_norm,
                              per_layer_input=per_layer[:, i] if per_layer is not None else None)
        if final is not None and normed is not None:
            return normed
        return current_ops().rms_norm(x, self.norm.weight, eps=self.norm.eps, gemma=self.norm.gemma,
                                      centered=self.norm.centered)

    def _per_layer_inputs(self, input_ids: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """(num_tokens,) ids and their scaled embeddings -> (num_tokens, layers, P): ``(norm(proj(embeddings) *
        hidden^-0.5) + table[ids] * sqrt(P)) * 2^-0.5`` (each scale rounded to the dtype, as HF's)."""
        n, size = input_ids.shape[0], self.config.per_layer_input_size
        table = self.embed_tokens_per_layer
        if table.num_embeddings < self.config.vocab_size:       # ids past the per-layer table read row 0
            input_ids = torch.where(input_ids < table.num_embeddings, input_ids, 0)
        tokens = table(input_ids) * torch.tensor(size ** 0.5, dtype=table.weight.dtype)
        projected = self.per_layer_model_projection(embeddings) * self.config.hidden_size ** -0.5
        projected = _normed(self.per_layer_projection_norm, projected.view(-1, size), current_ops())
        return (projected.view(n, -1, size) + tokens.view(n, -1, size)) * 2 ** -0.5

    def fuse_projections(self) -> None:
        """Pack the projections that read one input (q|k|v, gate|up) into one GEMM each, in place; the
        parameters stay (as views), so loading and ``state_dict`` are unchanged. The model runner calls this
        once the weights are where they will run."""
        for module in self.modules():
            if module is not self and hasattr(module, "fuse_projections"):
                module.fuse_projections()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(num_tokens, hidden_size) -> fp32 logits (num_tokens, vocab_size); None on tensor-parallel ranks
        other than 0 (the vocab-parallel head gathers the logits there)."""
        logits = self.lm_head(hidden.to(self.lm_head.weight.dtype), out_dtype=torch.float32)   # rounded, then fp32
        if logits is None:
            return None
        if self.config.logits_multiplier != 1.0:
            logits = logits * self.config.logits_multiplier
        cap = self.config.final_softcap
        return cap * torch.tanh(logits / cap) if cap is not None else logits

    def compute_logits_and_greedy(self, hidden: torch.Tensor, *, out: torch.Tensor | None = None,
                                  write_logits: torch.Tensor | None = None, report: torch.Tensor | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``compute_logits`` and each row's greedy token ((num_tokens,) int64: the logits' argmax, written into
        ``out`` when given). With nothing between the head and the logits (no multiplier, no softcap, one
        rank) the backend takes the argmax inside the head's kernel (``linear_argmax``), which may skip writing
        the logits where the device scalar ``write_logits`` is zero; ``report`` as the backend's ``argmax``. None
        where ``compute_logits`` is None."""
        ops = current_ops()
        head = self.lm_head
        if self.tp.size == 1 and self.config.logits_multiplier == 1.0 and self.config.final_softcap is None:
            return ops.linear_argmax(hidden.to(head.weight.dtype), head.weight, head.bias, out=out,
                                     write_logits=write_logits, report=report)
        logits = self.compute_logits(hidden)
        return None if logits is None else (logits, ops.argmax(logits, out=out, report=report))


# Initialisers module constructors call; patched to no-ops while building (as HF's no_init_weights).
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "xavier_uniform_", "xavier_normal_",
                   "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "zeros_", "ones_")


@contextlib.contextmanager
def bare_construction(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Build modules on ``device`` in ``dtype`` without running initialisers (every parameter is written
    afterwards). Buffers that must stay in fp32 (RoPE frequencies) are created with an explicit dtype by
    their modules. Not thread-safe: the torch.nn.init patch and the default dtype are process-wide."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    default_dtype = torch.get_default_dtype()
    try:
        for name in _INIT_FUNCTIONS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        torch.set_default_dtype(dtype)
        with device:
            yield
    finally:
        torch.set_default_dtype(default_dtype)
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


_HOST_NUMEL = 1 << 16      # meta_model: tensors up to this many elements are made on the host


def _factory_numel(name: str, args: tuple, kwargs: dict) -> int | None:
    """Elements a torch factory call would make (None: unknown)."""
    if name in ("tensor", "as_tensor", "asarray", "scalar_tensor"):
        return 0                                  # built from Python data: small in a constructor
    if name == "arange":
        start, end = (0, args[0]) if len(args) == 1 else args[:2]
        step = args[2] if len(args) > 2 else kwargs.get("step", 1)
        return max(0, math.ceil((float(end) - float(start)) / float(step)))
    if name in ("linspace", "logspace"):
        return int(args[2] if len(args) > 2 else kwargs["steps"])
    if name in ("full", "empty_strided"):
        size = args[0] if args else kwargs["size"]
    else:
        size = kwargs.get("size", args[0] if len(args) == 1 and not isinstance(args[0], int) else args)
    size = (size,) if isinstance(size, int) else size
    if not isinstance(size, tuple | list | torch.Size) or not all(isinstance(d, int) for d in size):
        return None
    return math.prod(size)


class _SmallOnHost(TorchFunctionMode):
    """While building a meta model: a factory call that makes at most ``_HOST_NUMEL`` elements makes them on
    the host, the rest go to the meta device. Constructors compute small tables (RoPE frequencies, Mamba's A,
    µP multipliers) from such tensors; on the meta device that arithmetic runs through Python reference
    kernels and imports torch._dynamo on first use (seconds), on the host it takes microseconds."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("device") is None and func in _FACTORIES:
            try:
                numel = _factory_numel(func.__name__, args, kwargs)
            except (TypeError, ValueError, KeyError, IndexError, ZeroDivisionError):
                numel = None
            if numel is not None and numel <= _HOST_NUMEL:
                kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.linspace, torch.logspace,
              torch.tensor, torch.as_tensor, torch.asarray, torch.scalar_tensor, torch.rand, torch.randn,
              torch.empty_strided}


def meta_model(config: HybridConfig, dtype: torch.dtype, *, tp: TensorParallel = SINGLE,
               device: torch.device | None = None) -> HybridModel:
    """The model (this rank's shard) with every shape and (almost) no memory: its parameters and buffers on
    the meta device, except small ones (at most ``_HOST_NUMEL`` elements, on the host; see ``_SmallOnHost``).
    Loaders compare a checkpoint's shapes and the device's memory with it before building the real one. With
    ``device``, a config whose parameters cannot fit it even by ``parameter_lower_bound`` is refused first:
    such a config (``hidden_size=10**9``) would make even this build slow or large (a RoPE table of 10**8
    frequencies, Mamba-1's A expanded from a small table)."""
    if device is not None:
        check_fits(parameter_lower_bound(config, tp.size), dtype, device, at_least=True)
    with bare_construction(torch.device("meta"), dtype), _SmallOnHost():
        return HybridModel(config, tp=tp)


def _new_model(config: HybridConfig, tp: TensorParallel, device: torch.device, dtype: torch.dtype) -> HybridModel:
    """An unfilled model for the host init, once its parameters are known to fit ``device`` (``check_fits`` on
    its meta twin). Unsharded: built on the CPU in fp32 (then moved by the caller). A shard: built straight on
    the device in ``dtype`` with initialisers skipped (``_init_weights`` writes every parameter), because a
    shard of a large model need not fit in host memory in fp32."""
    if tp.size > 1:
        return empty_model(config, dtype=dtype, device=device, tp=tp)
    check_device(device)
    count = parameter_count(meta_model(config, dtype, device=device))
    check_fits(count, dtype, device)
    check_fits(count, torch.float32, torch.device("cpu"), what="the model (drawn on the host in fp32)")
    return HybridModel(config)


def _init_weights(model: HybridModel, seed: int) -> None:
    """Deterministic small random init (std 0.02 linears/embeddings; norms at identity; Mamba A/dt
    as in Mamba2's own init) so random-init models are numerically well behaved. Each value is drawn at
    the parameter's full (unsharded) shape and cut to this rank's shard, so every tensor-parallel size
    gives the same model. One CPU generator draws every value in parameter order (``init="host"``)."""
    gen = torch.Generator().manual_seed(seed)
    shards, tp, mixers = model.parameter_shards(), model.tp, _mixer_configs(model)
    for name, p in model.named_parameters():
        shape = shards[name].full_shape(p.shape, tp.size) if name in shards else tuple(p.shape)
        _init_parameter(model, name, p, shape, gen, mixers=mixers,
                        matrix=partial(_normal_whole, model, name, p, shape, gen))


def _mixer_configs(model: HybridModel) -> dict[str, MixerConfig]:
    """Module path -> config of every mixer module in ``model``, whose kind may init its own parameters."""
    return {path: m.cfg for path, m in model.named_modules() if isinstance(getattr(m, "cfg", None), MixerConfig)}


def _init_parameter(model: HybridModel, name: str, p: torch.Tensor, shape: tuple[int, ...], gen: torch.Generator,
                    *, mixers: Mapping[str, MixerConfig], matrix: Callable[[], None]) -> None:
    """The init rule of one parameter of full ``shape`` (this rank holds a shard of it), drawing from
    ``gen`` on its device: its mixer kind's (``MixerConfig.init_parameter``, e.g. Mamba's A_log and dt bias), else
    ``matrix`` for a weight matrix (std 0.02, the only rule the two init paths draw differently) and identity values
    for 1-D parameters."""
    with torch.no_grad():
        value, owner = None, name
        while "." in owner:                     # the innermost mixer module that holds it
            owner = owner.rpartition(".")[0]
            if owner in mixers:
                value = mixers[owner].init_parameter(name[len(owner) + 1:], shape, gen)
                break
        if value is None and p.ndim == 1:
            p.fill_(_identity_value(model, name))
        elif value is None:
            matrix()
        elif isinstance(value, float):
            p.fill_(value)
        else:
            p.copy_(model.shard_of(name, value))


def _normal_whole(model: HybridModel, name: str, p: torch.Tensor, shape: tuple[int, ...],
                  gen: torch.Generator) -> None:
    """``init="host"``: the full tensor drawn at once from the shared generator, then cut."""
    p.copy_(model.shard_of(name, torch.randn(shape, generator=gen, device=gen.device) * 0.02))


def _identity_value(model: HybridModel, name: str) -> float:
    """1-D parameters without a kind's own init: biases 0, norm weights 1 (0 for Gemma norms, which add 1)."""
    return 0.0 if "bias" in name or ("norm" in name and model.config.norm == "gemma_rms") else 1.0


DEVICE_INIT_CHUNK = 1 << 26     # values per draw (256 MiB of fp32): the only full-precision temporary


def _param_seed(seed: int, name: str) -> int:
    """A generator seed per (seed, parameter name): values do not depend on the order or the set of other
    parameters, so every rank (which draws every full tensor) agrees on each one."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62)


def _init_weights_on_device(model: HybridModel, seed: int) -> None:
    """The same init scheme as ``_init_weights``, drawn where the parameters live (``init="device"``):
    each parameter has its own generator on its device (``_param_seed``) and its full tensor is drawn in
    chunks of at most ``DEVICE_INIT_CHUNK`` values along a dim it is *not* sharded on, each chunk cut to this
    rank's part and written in the parameter's dtype. Chunking depends on the full shape and the sharding
    rule only, so tp N is still exactly the shard of tp 1; no full-model fp32 copy is ever made. The
    values differ from ``init="host"`` (another generator) and may differ between device types."""
    shards, tp, mixers = model.parameter_shards(), model.tp, _mixer_configs(model)
    for name, p in model.named_parameters():
        shard = shards.get(name)
        shape = shard.full_shape(p.shape, tp.size) if shard is not None else tuple(p.shape)
        gen = torch.Generator(device=p.device).manual_seed(_param_seed(seed, name))
        _init_parameter(model, name, p, shape, gen, mixers=mixers,
                        matrix=partial(_normal_in_chunks, p, shape, shard, tp, gen, std=0.02))


def _normal_in_chunks(p: torch.Tensor, shape: tuple[int, ...], shard: Shard | None, tp: TensorParallel,
                      gen: torch.Generator, *, std: float) -> None:
    """Fill ``p`` (this rank's part of a tensor of full ``shape``) with N(0, std) values drawn in fp32, one
    chunk of the full tensor at a time along the first dim that is not the shard dim."""
    split = shard.dim if shard is not None else None
    along = next(d for d in range(len(shape)) if d != split)           # p.ndim >= 2 here
    per_row = math.prod(shape) // shape[along]
    rows = max(1, DEVICE_INIT_CHUNK // per_row)
    for start in range(0, shape[along], rows):
        n = min(rows, shape[along] - start)
        chunk_shape = list(shape)
        chunk_shape[along] = n
        value = torch.empty(chunk_shape, device=p.device, dtype=torch.float32).normal_(0.0, std, generator=gen)
        # The chunk spans the whole shard dim, so cutting it is the same cut as of the full tensor.
        p.narrow(along, start, n).copy_(shard.take(value, tp) if shard is not None else value)


INITS = ("auto", "host", "device")


def build_model(config: HybridConfig, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                seed: int = 0, tp: TensorParallel = SINGLE, init: str = "auto") -> HybridModel:
    """A model with deterministic random weights; on every tensor-parallel rank the shard of those same
    weights.

    ``init``: "host" draws every value with one seeded CPU generator (the same weights on every device and
    machine; ~150 M values/s, so minutes for a 100 B-parameter model); "device" builds the model straight
    on ``device`` in ``dtype`` (no initialisers, no host copy) and draws the values there
    (``_init_weights_on_device``: seconds for 100 B parameters on a GPU, different values than "host");
    "auto" is "device" on CUDA and "host" elsewhere (so CPU callers keep their weights)."""
    if init not in INITS:
        raise ValueError(f"build_model: init must be one of {INITS}, got {init!r}")
    device = torch.device(device)
    dtype = dtype or config.torch_dtype
    if init == "device" or (init == "auto" and device.type == "cuda"):
        check_device(device)
        check_fits(parameter_count(meta_model(config, dtype, tp=tp, device=device)), dtype, device)
        with bare_construction(device, dtype):
            model = HybridModel(config, tp=tp)
        _init_weights_on_device(model, seed)
        return model.eval()
    model = _new_model(config, tp, device, dtype)
    _init_weights(model, seed)
    return model.to(device=device, dtype=dtype).eval()


def save_model(model: HybridModel, directory: str | Path) -> None:
    """``config.json`` (the HybridConfig) + ``model.safetensors`` (tied weights stored once)."""
    if model.tp.size > 1:
        raise ValueError("save_model: this model is one tensor-parallel shard; save the unsharded model")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).write_text(json.dumps(model.config.to_dict(), indent=1))
    # Packed projections (``fuse_projections``) are views into one storage; saved as tensors of their own.
    state = {k: v.clone() if v.untyped_storage().nbytes() > v.numel() * v.element_size() else v.contiguous()
             for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(directory / WEIGHTS_NAME))


def parameter_count(model: nn.Module) -> int:
    """Elements of ``model``'s parameters (tied ones once)."""
    return sum(p.numel() for p in model.parameters())


def all_finite(tensor: torch.Tensor) -> bool:
    """True unless a floating-point ``tensor`` holds a NaN or an infinity. One min/max reduction (NaN
    propagates through both): at the speed of a copy, where ``isfinite().all()`` is several times slower on
    the CPU (it writes a bool per element)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    if tensor.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        tensor = tensor.float()                    # fp8: no min/max kernels
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def copy_finite(dest: torch.Tensor, value: torch.Tensor) -> bool:
    """``dest.copy_(value)`` (converting dtype and device); True unless ``dest`` now holds NaN or inf. The check
    reads the narrower of the two when both are on one device: a widening conversion (bf16 -> fp32) keeps
    finite values finite, so the source answers for it at half the bytes; a narrowing one (fp32 -> fp16) can
    overflow, so the parameter itself is read."""
    with torch.no_grad():
        dest.copy_(value)
    widening = (value.is_floating_point() and value.element_size() < dest.element_size()
                and value.device == dest.device)
    return all_finite(value if widening else dest)


def _full_shapes(model: HybridModel) -> dict[str, tuple[int, ...]]:
    """Parameter name (tied aliases once) -> the full (unsharded) shape its tensor has in a checkpoint."""
    shards = model.parameter_shards()
    return {name: shards[name].full_shape(p.shape, model.tp.size) if name in shards else tuple(p.shape)
            for name, p in model.named_parameters()}


def _check_names(expected: Iterable[str], names: Iterable[str], where: str) -> None:
    expected, names = set(expected), set(names)
    missing, unexpected = sorted(expected - names), sorted(names - expected)
    if missing or unexpected:
        raise ValueError(f"{where}: missing tensors {missing[:5]}, unexpected {unexpected[:5]}")


def check_full_shapes(model: HybridModel, shapes: Mapping[str, tuple[int, ...]], *, where: str) -> None:
    """Compare a full state's tensor shapes (``shapes``: name -> shape, e.g. a safetensors header) with the
    model's, before anything is read: missing, unexpected and mis-shaped tensors are one error naming them."""
    expected = _full_shapes(model)
    _check_names(expected, shapes, where)
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise ValueError(f"{where}: {name} has shape {tuple(shapes[name])}, the config gives {shape}")


def load_full_state(model: HybridModel, tensors: Callable[[str], torch.Tensor], names: Iterable[str],
                    *, where: str, check_finite: bool = False) -> None:
    """Fill ``model`` from full (unsharded) tensors: ``names`` are the available tensor names, ``tensors``
    reads one (streamed, so only one full tensor is in memory at a time); each is cut to this rank's shard.
    Missing or unexpected tensors and shape mismatches are errors naming them; with ``check_finite`` so is a
    tensor holding NaN or inf (as this rank holds it, i.e. also one the dtype conversion overflowed)."""
    params = dict(model.named_parameters())           # a tied alias (lm_head.weight) is listed once
    _check_names(params, names, where)
    shapes = _full_shapes(model)
    for name, param in params.items():
        tensor = tensors(name)
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"{where}: {name} has shape {tuple(tensor.shape)}, the config gives {shapes[name]}")
        value = model.shard_of(name, tensor)
        if check_finite:
            if not copy_finite(param, value):
                raise ValueError(f"{where}: tensor {name} holds NaN or inf{overflow_note(tensor, param)}")
        else:
            with torch.no_grad():
                param.copy_(value)


def overflow_note(source: torch.Tensor, loaded: torch.Tensor) -> str:
    """Why a loaded tensor is not finite when its source is: the conversion to its dtype overflowed ("" when the
    source is not finite either)."""
    if source.dtype == loaded.dtype or not all_finite(source):
        return ""
    top = source.abs().max().item()
    return f" after conversion to {str(loaded.dtype).removeprefix('torch.')} (|value| up to {top:.4g} overflows it)"


def empty_model(config: HybridConfig, *, dtype: torch.dtype, device: str | torch.device,
                tp: TensorParallel = SINGLE, meta: HybridModel | None = None) -> HybridModel:
    """A model (this rank's shard) to be filled from a checkpoint: its meta twin (``meta``, else built here)
    must fit ``device`` first; then it is built there in ``dtype`` with initialisers skipped (every parameter is
    overwritten, and random init of a 7B model costs more than reading it)."""
    device = torch.device(device)
    check_device(device)
    check_fits(parameter_count(meta if meta is not None else meta_model(config, dtype, tp=tp, device=device)),
               dtype, device)
    with bare_construction(device, dtype):
        model = HybridModel(config, tp=tp)
    for param in model.parameters():       # a few are created in fp32 on purpose (e.g. Mamba's A_log)
        if param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model


def shard_model(config: HybridConfig, state: Mapping[str, torch.Tensor], *, tp: TensorParallel,
                dtype: torch.dtype, device: str | torch.device = "cpu") -> HybridModel:
    """This rank's shard of the model whose full parameters are ``state`` (an in-memory model's
    ``state_dict``; a tied ``lm_head.weight`` alias is ignored)."""
    model = empty_model(config, dtype=dtype, device=device, tp=tp)
    names = [n for n in state if not (config.tie_word_embeddings and n == "lm_head.weight")]
    load_full_state(model, state.__getitem__, names, where="state dict")
    return model.eval()


def load_model(directory: str | Path, *, dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu", tp: TensorParallel = SINGLE) -> HybridModel:
    """Load a model saved by ``save_model`` (each tensor-parallel rank reads its shard of every tensor).

    Before anything is allocated: the config is validated, the file's header is checked (a truncated or
    corrupt file is one error naming it), its tensor names and shapes are compared with the model's, and the
    parameters must fit the device. Then tensors stream in one at a time; one holding NaN or inf is an error
    naming it."""
    directory = Path(directory)
    config_file, weights = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    try:
        raw = json.loads(config_file.read_text())
    except OSError as err:
        raise FileNotFoundError(f"{config_file}: cannot read: {err.strerror or err}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_file} is not valid JSON: {err}") from None
    try:
        config = HybridConfig.from_dict(raw)
    except ValueError as err:
        raise ValueError(f"{config_file}: {err}") from None
    dtype = dtype or config.torch_dtype
    device = torch.device(device)
    if not weights.is_file():
        raise CheckpointError(f"{directory}: no {WEIGHTS_NAME}")
    header = read_header(weights)
    names = [n for n in header if not (config.tie_word_embeddings and n == "lm_head.weight")]
    check_device(device)
    try:
        meta = meta_model(config, dtype, tp=tp, device=device)
        check_full_shapes(meta, {n: header[n].shape for n in names}, where=str(weights))
        model = empty_model(config, dtype=dtype, device=device, tp=tp, meta=meta)
    except MemoryError as err:
        raise MemoryError(f"{directory}: {err}") from None
    with TensorReader(weights) as reader:
        load_full_state(model, reader.get, names, where=str(weights), check_finite=True)
    return model.eval()
