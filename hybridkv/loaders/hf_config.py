"""HF ``config.json`` -> ``HybridConfig``: one converter per architecture, registered by name.

The reference is transformers' own modeling code (5.23): every converter reads the keys that HF's
modules read, falls back to HF's class defaults for keys a checkpoint omits (released multimodal
configs store only the non-default text fields), and derives the per-layer mix the way HF does
(``layer_types``, ``no_rope_layers``, ``hybrid_override_pattern``, periods and offsets, ...). Both the
hub's older spelling (``rope_theta`` + ``rope_scaling``) and the 5.x ``to_dict()`` spelling
(``rope_parameters``) are read.

Nothing here imports transformers: a config is plain data, and planning must work without it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from hybridkv.models.config import (
    MAX_DIM,
    MAX_LAYERS,
    MLP,
    AltUp,
    Attention,
    DenseMoE,
    GatedDeltaNet,
    HybridConfig,
    KimiDeltaAttention,
    Layer,
    Mamba1,
    Mamba2,
    MoE,
    MultiLatentAttention,
    Rope,
    SharedBlock,
    ShortConv,
)

Converter = Callable[[Mapping[str, Any]], HybridConfig]

CONVERTERS: dict[str, Converter] = {}

# ``model_type`` -> architecture, for configs without ``architectures`` (e.g. ``XxxConfig().to_dict()``).
MODEL_TYPES: dict[str, str] = {
    "llama4_text": "Llama4ForCausalLM",
    "llama4": "Llama4ForConditionalGeneration",
    "mamba2": "Mamba2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gemma3n_text": "Gemma3nForCausalLM",
    "gemma3n": "Gemma3nForConditionalGeneration",
    "gemma4_text": "Gemma4ForCausalLM",
    "gemma4": "Gemma4ForConditionalGeneration",
    "cohere2": "Cohere2ForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "granite_swa": "GraniteSWAForCausalLM",
    "granitemoe_swa": "GraniteMoeSWAForCausalLM",
    "bamba": "BambaForCausalLM",
    "jamba": "JambaForCausalLM",
    "zamba2": "Zamba2ForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "lfm2_moe": "Lfm2MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "olmo_hybrid": "OlmoHybridForCausalLM",
}

# Planning length for models without a position limit (pure Mamba): Mamba-Codestral's card reports
# tests up to 256k tokens. Only the default of ``max_model_len``; a Mamba state does not depend on it.
UNBOUNDED_POSITIONS = 262144

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_new": "gelu_tanh", "gelu_tanh": "gelu_tanh", "relu2": "relu2"}
_INF = math.inf


def register(*architectures: str) -> Callable[[Converter], Converter]:
    """Register ``fn`` as the converter for ``architectures`` (HF ``architectures[0]`` names)."""

    def wrap(fn: Converter) -> Converter:
        for name in architectures:
            CONVERTERS[name] = fn
        return fn

    return wrap


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(CONVERTERS))


def architecture_of(config: Mapping[str, Any]) -> str:
    """The architecture a converter is registered for: the first supported ``architectures`` entry,
    else the one ``model_type`` implies."""
    names = config.get("architectures") or []
    for name in names:
        if name in CONVERTERS:
            return name
    if not names and config.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[config["model_type"]]
    found = ", ".join(names) or f"model_type={config.get('model_type')!r}"
    raise ValueError(f"unsupported architecture {found}; supported: {', '.join(supported_architectures())}")


# Sizes every family reads (when present and not null: integers in range), and the per-layer lists and
# patterns (at most MAX_LAYERS entries); checked before a converter loops over the layers.
_SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings")
_PER_LAYER_KEYS = ("layer_types", "layers_block_type", "hybrid_override_pattern", "no_rope_layers", "moe_layers",
                   "attn_layer_indices", "full_attn_idxs", "layer_rope_theta", "intermediate_size",
                   "activation_sparsity_pattern")


def _check_sizes(arch: str, config: Mapping[str, Any]) -> None:
    """The sizes and layer lists of one (text) config: integers, at least 1, within the sanity bounds."""
    for key in _SIZE_KEYS:
        value = config.get(key)
        if value is None:
            continue
        # Gemma-3n: one MLP width per layer
        values = value[:MAX_LAYERS + 1] if key == "intermediate_size" and isinstance(value, list) else [value]
        for value in values:
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{arch}: {key} must be an integer, got {value!r} ({type(value).__name__})")
            limit = MAX_LAYERS if key == "num_hidden_layers" else MAX_DIM
            if not 1 <= value <= limit:
                raise ValueError(f"{arch}: {key}={value} is out of range (1 to {limit})")
    for key in _PER_LAYER_KEYS:
        value = config.get(key)
        if isinstance(value, list | str) and len(value) > MAX_LAYERS:
            raise ValueError(f"{arch}: {key} has {len(value)} entries, more than the {MAX_LAYERS} layers supported")


def hf_config_to_hybrid(config: Mapping[str, Any]) -> HybridConfig:
    """Convert an HF ``config.json`` dict (or an HF config's ``to_dict()``) to a ``HybridConfig``. Sizes are
    checked before the converter runs (a ``num_hidden_layers`` of 10**6 is refused at once, not built), and a
    value of the wrong type anywhere is a ``ValueError`` naming the architecture."""
    if not isinstance(config, Mapping):
        raise ValueError(f"expected a config dict, got {type(config).__name__}")
    arch = architecture_of(config)
    _check_sizes(arch, config)
    text = config.get("text_config")
    if isinstance(text, Mapping):
        _check_sizes(f"{arch} text_config", text)
    try:
        return CONVERTERS[arch](config)
    except (TypeError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError) as err:
        raise ValueError(f"{arch}: invalid config ({type(err).__name__}: {err})") from None


def _decode_special_floats(obj: dict[str, Any]) -> Any:
    """transformers 5.x writes inf/nan as ``{"__float__": "Infinity"}`` (valid JSON); decode them."""
    return float(obj["__float__"]) if obj.keys() == {"__float__"} else obj


def read_config_json(path: str | Path) -> dict[str, Any]:
    """Read ``path`` (a config.json, or a checkpoint directory holding one) as a dict."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no config file at {file}")
    try:
        data = json.loads(file.read_text(), object_hook=_decode_special_floats)
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def load_config(source: str | Path | Mapping[str, Any]) -> HybridConfig:
    """A ``HybridConfig`` from a path or dict holding either an HF config or a hybridkv-native one."""
    data = source if isinstance(source, Mapping) else read_config_json(source)
    try:
        if "hybridkv_config" in data:
            return HybridConfig.from_dict(dict(data))
        return hf_config_to_hybrid(data)
    except ValueError as err:
        if isinstance(source, Mapping):
            raise
        file = Path(source) / "config.json" if Path(source).is_dir() else Path(source)
        raise ValueError(f"{file}: {err}") from None


# -- shared helpers --------------------------------------------------------------------------------------
class _Fields:
    """One config dict laid over HF's class defaults; missing keys name the architecture."""

    def __init__(self, arch: str, raw: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
        self.arch = arch
        self.raw = raw
        self._data = {**defaults, **raw}

    def __getitem__(self, key: str) -> Any:
        try:
            return self._data[key]
        except KeyError:
            raise ValueError(f"{self.arch}: config lacks the key {key!r}") from None

    def get(self, key: str, default: Any = None) -> Any:
        return self._data.get(key, default)

    def first(self, *keys: str, default: Any = None) -> Any:
        """The first of ``keys`` present and not null (for renamed keys)."""
        for key in keys:
            if self._data.get(key) is not None:
                return self._data[key]
        return default

    def kv_heads(self) -> int:
        return self["num_key_value_heads"] or self["num_attention_heads"]


def _activation(name: str, owner: str) -> str:
    if name not in _ACTIVATIONS:
        raise ValueError(f"{owner}: unsupported activation {name!r} (supported: {', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


def _dtype(*configs: Mapping[str, Any]) -> str:
    """The checkpoint dtype: ``dtype`` (5.x) or ``torch_dtype`` (4.x), innermost config first; float32
    (what HF instantiates) when no config names one."""
    for cfg in configs:
        value = cfg.get("dtype") or cfg.get("torch_dtype")
        if value:
            name = str(value).removeprefix("torch.")
            if not isinstance(getattr(torch, name, None), torch.dtype):
                raise ValueError(f"unknown dtype {value!r} in config")
            return name
    return "float32"


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list | tuple) else (int(value),)


def _rope(params: Mapping[str, Any] | None, *, theta: float, interleaved: bool = False,
          partial_rotary_factor: float | None = None, max_positions: int | None = None) -> Rope:
    """A ``Rope`` from one (flat) RoPE parameter dict; ``theta``/``partial_rotary_factor`` fill gaps;
    ``max_positions``: YaRN's factor when the dict has none (max / original positions, as HF)."""
    params = dict(params or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    partial = params.get("partial_rotary_factor", partial_rotary_factor)
    common = dict(theta=float(params.get("rope_theta") or theta), interleaved=interleaved,
                  partial_rotary_factor=float(partial if partial is not None else 1.0))
    if kind == "default":
        return Rope(**common)
    if kind == "linear":
        return Rope(scaling="linear", factor=float(params["factor"]), **common)
    if kind == "llama3":
        return Rope(scaling="llama3", factor=float(params["factor"]),
                    low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                    high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                    original_max_position_embeddings=int(
                        params.get("original_max_position_embeddings", 8192)),
                    **common)
    if kind == "yarn":
        original = int(params["original_max_position_embeddings"])
        factor = params.get("factor")
        if factor is None:
            if max_positions is None:
                raise ValueError("YaRN RoPE without a factor needs max_position_embeddings")
            factor = max_positions / original

        def optional(key: str) -> float | None:
            return float(params[key]) if params.get(key) is not None else None

        return Rope(scaling="yarn", factor=float(factor), original_max_position_embeddings=original,
                    beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                    truncate=bool(params.get("truncate", True)), attention_factor=optional("attention_factor"),
                    mscale=optional("mscale"), mscale_all_dim=optional("mscale_all_dim"), **common)
    raise ValueError(f"RoPE type {kind!r} is not supported (supported: default, linear, llama3, yarn)")


def _rope_params(cfg: _Fields) -> dict[str, Any]:
    """HF's priority: ``rope_scaling`` (4.x), else ``rope_parameters`` (5.x), then ``rope_theta``."""
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    if cfg.get("rope_theta") is not None:
        params.setdefault("rope_theta", cfg.get("rope_theta"))
    return params


def _check_layer_types(arch: str, types: Iterable[str], allowed: Iterable[str], *, count: int | None = None,
                       key: str = "layer_types") -> list[str]:
    """``types`` as a list, each one of ``allowed``, and (``count``) one per layer."""
    allowed = tuple(allowed)
    types = list(types)
    for i, kind in enumerate(types):
        if kind not in allowed:
            raise ValueError(f"{arch}: layer {i} has unknown layer type {kind!r} (expected one of "
                             f"{', '.join(allowed)})")
    if count is not None and len(types) != count:
        raise ValueError(f"{arch}: {key} has {len(types)} entries for {count} layers")
    return types


def _mamba_heads(cfg: _Fields, intermediate: int, heads_key: str, head_key: str) -> tuple[int, int]:
    """(heads, head_dim) with HF's ``"auto"`` head dim = intermediate // heads, checked as HF does."""
    heads = cfg[heads_key]
    head_dim = cfg[head_key]
    if head_dim in (None, "auto"):
        head_dim = intermediate // heads
    if heads * head_dim != intermediate:
        raise ValueError(f"{cfg.arch}: {heads_key}={heads} x {head_key}={head_dim} must equal the Mamba "
                         f"inner size {intermediate}")
    return heads, head_dim


def _check_silu(cfg: _Fields, key: str) -> None:
    if cfg[key] not in ("silu", "swish"):
        raise ValueError(f"{cfg.arch}: Mamba layers support only the silu activation, got {key}={cfg[key]!r}")


def _time_step_limit(value: Any) -> tuple[float, float]:
    return (0.0, _INF) if value is None else (float(value[0]), float(value[1]))


def _model(cfg: _Fields, layers: Iterable[Layer], *, outer: Mapping[str, Any] | None = None,
           **overrides: Any) -> HybridConfig:
    """The HybridConfig fields every family shares; ``overrides`` take precedence."""
    outer = outer or {}
    fields: dict[str, Any] = dict(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], layers=tuple(layers),
        norm_eps=cfg.get("rms_norm_eps", 1e-6), tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
        max_position_embeddings=cfg["max_position_embeddings"], dtype=_dtype(cfg.raw, outer),
        architecture=cfg.arch, bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_token_ids(outer.get("eos_token_id", cfg.get("eos_token_id"))))
    fields.update(overrides)
    return HybridConfig(**fields)


def _text_part(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The decoder's config of a multimodal checkpoint (``text_config``), else the config itself."""
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


# -- Llama-4 -----------------------------------------------------------------------------------------------
_LLAMA4_TEXT_DEFAULTS = dict(
    vocab_size=202048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
    num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128, hidden_act="silu",
    max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False, num_experts_per_tok=1, num_local_experts=16, moe_layers=None,
    interleave_moe_layer_step=1, use_qk_norm=True, no_rope_layers=None, no_rope_layer_interval=4,
    attention_chunk_size=8192, layer_types=None, attn_temperature_tuning=True, floor_scale=8192,
    attn_scale=0.1, attention_bias=False)


@register("Llama4ForCausalLM", "Llama4ForConditionalGeneration")
def llama4(config: Mapping[str, Any]) -> HybridConfig:
    """RoPE layers are chunked-local, NoPE layers global (HF ``layer_types``); weightless qk-norm after
    RoPE on RoPE layers; temperature tuning on NoPE layers (``attn_temperature_tuning`` may be the int 4
    the hub config holds); MoE layers from ``moe_layers`` or the interleave step."""
    arch = architecture_of(config)
    cfg = _Fields(arch, _text_part(config), _LLAMA4_TEXT_DEFAULTS)
    n = cfg["num_hidden_layers"]
    interval = cfg.first("no_rope_layer_interval", "nope_layer_interval", default=4)
    uses_rope = cfg["no_rope_layers"] or [int((i + 1) % interval != 0) for i in range(n)]
    if len(uses_rope) < n:
        raise ValueError(f"{arch}: no_rope_layers has {len(uses_rope)} entries for {n} layers")
    step = cfg["interleave_moe_layer_step"]
    moe_layers = set(cfg["moe_layers"] if cfg["moe_layers"] is not None else range(step - 1, n, step))
    types = cfg["layer_types"] or ["chunked_attention" if r else "full_attention" for r in uses_rope]
    types = _check_layer_types(arch, types[:n], ("chunked_attention", "full_attention"))
    rope = _rope(_rope_params(cfg), theta=500000.0, interleaved=True)
    act = _activation(cfg["hidden_act"], arch)
    tuning = (float(cfg["attn_scale"]), float(cfg["floor_scale"])) if cfg["attn_temperature_tuning"] else None
    moe = MoE(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
              intermediate_size=cfg["intermediate_size"], router="sigmoid_input", renormalize=False,
              shared_intermediate_size=cfg["intermediate_size"], activation=act)
    dense = MLP(intermediate_size=cfg["intermediate_size_mlp"], activation=act)
    layers = []
    for i in range(n):
        with_rope = bool(uses_rope[i])
        attention = Attention(
            num_heads=cfg["num_attention_heads"], num_kv_heads=cfg.kv_heads(),
            head_dim=cfg["head_dim"] or cfg["hidden_size"] // cfg["num_attention_heads"],
            attention_chunk_size=cfg["attention_chunk_size"] if types[i] == "chunked_attention" else None,
            rope=rope if with_rope else None,
            qk_norm="rms_weightless" if cfg["use_qk_norm"] and with_rope else None,
            temperature_tuning=None if with_rope else tuning,
            qkv_bias=cfg["attention_bias"], o_bias=cfg["attention_bias"])
        layers.append(Layer(mixer=attention, ffn=moe if i in moe_layers else dense))
    tie = config.get("tie_word_embeddings", cfg["tie_word_embeddings"])
    return _model(cfg, layers, outer=config if cfg.raw is not config else None, norm_eps=cfg["rms_norm_eps"],
                  tie_word_embeddings=bool(tie))


# -- Mistral -----------------------------------------------------------------------------------------------
_MISTRAL_DEFAULTS = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=None, hidden_act="silu", max_position_embeddings=131072,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, sliding_window=4096)


@register("MistralForCausalLM")
def mistral(config: Mapping[str, Any]) -> HybridConfig:
    """Every layer slides over ``sliding_window`` keys; null means full attention (HF ignores
    ``layer_types`` for Mistral, and so do we)."""
    cfg = _Fields("MistralForCausalLM", config, _MISTRAL_DEFAULTS)
    head_dim = cfg["head_dim"] or cfg["hidden_size"] // cfg["num_attention_heads"]
    attention = Attention(num_heads=cfg["num_attention_heads"], num_kv_heads=cfg.kv_heads(),
                          head_dim=head_dim, sliding_window=cfg["sliding_window"],
                          rope=_rope(_rope_params(cfg), theta=10000.0))
    mlp = MLP(intermediate_size=cfg["intermediate_size"], activation=_activation(cfg["hidden_act"], cfg.arch))
    return _model(cfg, [Layer(mixer=attention, ffn=mlp)] * cfg["num_hidden_layers"])


# -- Gemma-2 / Gemma-3 -------------------------------------------------------------------------------------
_GEMMA2_DEFAULTS = dict(
    vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
    rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True, attention_bias=False,
    query_pre_attn_scalar=256, sliding_window=4096, layer_types=None, final_logit_softcapping=30.0,
    attn_logit_softcapping=50.0, use_bidirectional_attention=None)
_GEMMA3_TEXT_DEFAULTS = {
    **_GEMMA2_DEFAULTS, "vocab_size": 262208, "max_position_embeddings": 131072,
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False,
    "sliding_window_pattern": 6}
_GEMMA_LAYER_TYPES = ("sliding_attention", "full_attention")


def _gemma(cfg: _Fields, types: list[str], ropes: Mapping[str, Rope], *, qk_norm: str | None,
           outer: Mapping[str, Any] | None = None, tie: bool | None = None) -> HybridConfig:
    """Gemma-2/3 share everything but the layer pattern, RoPE per layer type and the q/k norms."""
    if cfg["use_bidirectional_attention"]:
        raise ValueError(f"{cfg.arch}: use_bidirectional_attention is not supported (not a causal decoder)")
    n = cfg["num_hidden_layers"]
    types = _check_layer_types(cfg.arch, types[:n], _GEMMA_LAYER_TYPES)
    softcap = cfg["attn_logit_softcapping"]
    mlp = MLP(intermediate_size=cfg["intermediate_size"],
              activation=_activation(cfg["hidden_activation"], cfg.arch))
    layers = []
    for kind in types:
        attention = Attention(
            num_heads=cfg["num_attention_heads"], num_kv_heads=cfg.kv_heads(), head_dim=cfg["head_dim"],
            sliding_window=cfg["sliding_window"] if kind == "sliding_attention" else None, rope=ropes[kind],
            qk_norm=qk_norm, scale=float(cfg["query_pre_attn_scalar"]) ** -0.5,
            softcap=float(softcap) if softcap else None,
            qkv_bias=cfg["attention_bias"], o_bias=cfg["attention_bias"])
        layers.append(Layer(mixer=attention, ffn=mlp, sandwich_norm=True))
    final_softcap = cfg["final_logit_softcapping"]
    return _model(cfg, layers, outer=outer, norm="gemma_rms", norm_eps=cfg["rms_norm_eps"],
                  embedding_multiplier=float(cfg["hidden_size"]) ** 0.5,
                  final_softcap=float(final_softcap) if final_softcap else None,
                  tie_word_embeddings=bool(cfg["tie_word_embeddings"] if tie is None else tie))


@register("Gemma2ForCausalLM")
def gemma2(config: Mapping[str, Any]) -> HybridConfig:
    """Alternating sliding/global layers (sliding first) unless ``layer_types`` says otherwise; one RoPE."""
    cfg = _Fields("Gemma2ForCausalLM", config, _GEMMA2_DEFAULTS)
    n = cfg["num_hidden_layers"]
    types = cfg["layer_types"] or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    rope = _rope(_rope_params(cfg), theta=10000.0)
    return _gemma(cfg, types, {kind: rope for kind in _GEMMA_LAYER_TYPES}, qk_norm=None)


@register("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
def gemma3(config: Mapping[str, Any]) -> HybridConfig:
    """``layer_types`` or every ``sliding_window_pattern``-th layer global; local layers rotate with
    ``rope_local_base_freq`` and no scaling, global ones with ``rope_theta`` and ``rope_scaling``."""
    arch = architecture_of(config)
    cfg = _Fields(arch, _text_part(config), _GEMMA3_TEXT_DEFAULTS)
    n = cfg["num_hidden_layers"]
    pattern = cfg["sliding_window_pattern"]
    types = cfg["layer_types"] or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    outer = config if cfg.raw is not config else None
    tie = config.get("tie_word_embeddings", True) if outer is not None else None
    return _gemma(cfg, types, _gemma3_ropes(cfg), qk_norm="rms", outer=outer, tie=tie)


def _gemma3_ropes(cfg: _Fields) -> dict[str, Rope]:
    """Gemma-3 / 3n RoPE per layer type: 5.x's ``rope_parameters`` (one dict per type), else the hub spelling
    (global: ``rope_theta`` and ``rope_scaling``; local: ``rope_local_base_freq``, no scaling)."""
    nested = cfg.get("rope_parameters") or {}
    if isinstance(nested, Mapping) and "full_attention" in nested:      # 5.x: one dict per layer type
        full, local = dict(nested["full_attention"]), dict(nested.get("sliding_attention") or {})
    else:
        full = dict(cfg.get("rope_scaling") or nested or {})
        full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    return {"full_attention": _rope(full, theta=1_000_000.0), "sliding_attention": _rope(local, theta=10_000.0)}


# -- Gemma-4 --------------------------------------------------------------------------------------------------
_GEMMA4_TEXT_DEFAULTS = dict(
    vocab_size=262144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
    rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True, rope_parameters=None,
    attention_bias=False, sliding_window=512, layer_types=None, final_logit_softcapping=None,
    use_bidirectional_attention=None, vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256,
    attention_k_eq_v=False, num_kv_shared_layers=0, enable_moe_block=False, use_double_wide_mlp=False,
    num_experts=None, top_k_experts=None, moe_intermediate_size=None, global_head_dim=512,
    num_global_key_value_heads=None, per_layer_config=None)
_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}


def _gemma4_rope(params: Mapping[str, Any]) -> Rope:
    params = dict(params)
    if params.get("rope_type") == "proportional":
        return Rope(theta=float(params["rope_theta"]), scaling="proportional", factor=float(params.get("factor", 1.0)),
                    partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)))
    return _rope(params, theta=10_000.0)


def _gemma4_layer_shapes(cfg: _Fields, types: list[str]) -> list[tuple[int, int]]:
    """(head_dim, kv heads) per layer as HF's ``per_layer_config`` resolves them: a saved ``per_layer_config``
    (layer index -> overrides), else global layers take ``global_head_dim`` and, with ``attention_k_eq_v``,
    ``num_global_key_value_heads``."""
    base = (cfg["head_dim"], cfg.kv_heads())
    overrides = cfg["per_layer_config"]
    if overrides is None:
        full: dict[str, Any] = {"head_dim": cfg["global_head_dim"]}
        if cfg["attention_k_eq_v"] and cfg["num_global_key_value_heads"] is not None:
            full["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        overrides = {str(i): full for i, kind in enumerate(types) if kind == "full_attention"}
    shapes = [base] * len(types)
    for key, values in dict(overrides).items():
        i = int(key)
        unknown = set(values) - {"head_dim", "num_key_value_heads"}
        if unknown or not 0 <= i < len(types):
            raise ValueError(f"{cfg.arch}: per_layer_config[{key!r}] sets {sorted(unknown)} or names no layer "
                             f"(only head_dim / num_key_value_heads per layer are supported)")
        shapes[i] = (int(values.get("head_dim", base[0])), int(values.get("num_key_value_heads", base[1])))
    return shapes


def _kv_donors(arch: str, types: list[str], shared: int) -> list[int | None]:
    """Per layer, the layer whose KV cache it reads (HF ``kv_sharing_modes``): each of the last ``shared`` layers
    reuses the last earlier non-shared layer of its own type; the others keep their own (None)."""
    n = len(types)
    first = n - shared
    if not 0 <= shared < n:
        raise ValueError(f"{arch}: num_kv_shared_layers={shared} must be below num_hidden_layers={n} (some layer "
                         f"must keep the cache the others read)")
    donors: list[int | None] = [None] * n
    for i in range(first, n):
        owners = [j for j in range(first) if types[j] == types[i]]
        if not owners:
            raise ValueError(f"{arch}: layer {i} ({types[i]}) shares the KV cache of an earlier {types[i]} layer, "
                             f"but none of the first {first} layers is one")
        donors[i] = owners[-1]
    return donors


@register("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
def gemma4(config: Mapping[str, Any]) -> HybridConfig:
    """Gemma-4's text decoder (``Gemma4TextModel``): sliding / global layers of their own head dim and kv heads
    (``global_head_dim``, ``num_global_key_value_heads`` with ``attention_k_eq_v``: the global layers' values are
    their keys), q/k RMS norms with a weight and a weightless value norm, softmax scale 1, RoPE per layer type (the
    global one proportional), the last ``num_kv_shared_layers`` layers reading an earlier layer's KV cache (with
    ``use_double_wide_mlp`` their MLPs twice as wide), per-layer inputs (``hidden_size_per_layer_input``), a learned
    scalar per layer and the final logit softcap. Norms scale by w (not Gemma-3's 1 + w). With ``enable_moe_block``
    (26B-A4B) every layer runs its dense MLP and routed experts side by side (``DenseMoE``)."""
    arch = architecture_of(config)
    cfg = _Fields(arch, _text_part(config), _GEMMA4_TEXT_DEFAULTS)
    if cfg["use_bidirectional_attention"] == "all":
        raise ValueError(f"{arch}: use_bidirectional_attention='all' is not supported (not a causal decoder)")
    n = cfg["num_hidden_layers"]
    types = cfg["layer_types"] or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    types = _check_layer_types(arch, types[:n], _GEMMA_LAYER_TYPES, count=n)
    types[-1] = "full_attention"                              # HF forces the last layer global
    ropes = {kind: _gemma4_rope(params) for kind, params in {**_GEMMA4_ROPE, **(cfg["rope_parameters"] or {})}.items()}
    shapes = _gemma4_layer_shapes(cfg, types)
    donors = _kv_donors(arch, types, cfg["num_kv_shared_layers"])
    act = _activation(cfg["hidden_activation"], arch)
    layers = []
    for i, kind in enumerate(types):
        head_dim, kv_heads = shapes[i]
        sliding = kind == "sliding_attention"
        attention = Attention(
            num_heads=cfg["num_attention_heads"], num_kv_heads=kv_heads, head_dim=head_dim,
            sliding_window=cfg["sliding_window"] if sliding else None, rope=ropes[kind], qk_norm="rms", scale=1.0,
            qkv_bias=cfg["attention_bias"], o_bias=cfg["attention_bias"], value_norm=donors[i] is None,
            k_eq_v=bool(cfg["attention_k_eq_v"]) and not sliding and donors[i] is None, kv_source=donors[i])
        wide = 2 if cfg["use_double_wide_mlp"] and donors[i] is not None else 1
        ffn: MLP | DenseMoE = MLP(intermediate_size=wide * cfg["intermediate_size"], activation=act)
        if cfg["enable_moe_block"]:
            ffn = DenseMoE(mlp=ffn, moe=MoE(num_experts=cfg["num_experts"], top_k=cfg["top_k_experts"],
                                            intermediate_size=cfg["moe_intermediate_size"], activation=act))
        layers.append(Layer(mixer=attention, ffn=ffn, sandwich_norm=True))
    per_layer = cfg["hidden_size_per_layer_input"] or 0
    if per_layer and cfg["vocab_size_per_layer_input"] < cfg["vocab_size"]:
        raise ValueError(f"{arch}: vocab_size_per_layer_input={cfg['vocab_size_per_layer_input']} is below "
                         f"vocab_size={cfg['vocab_size']} (HF would index past the per-layer table)")
    final_softcap = cfg["final_logit_softcapping"]
    outer = config if cfg.raw is not config else None
    tie = config.get("tie_word_embeddings", True) if outer is not None else cfg["tie_word_embeddings"]
    return _model(cfg, layers, outer=outer, norm="rms", norm_eps=cfg["rms_norm_eps"],
                  embedding_multiplier=float(cfg["hidden_size"]) ** 0.5,
                  final_softcap=float(final_softcap) if final_softcap else None, tie_word_embeddings=bool(tie),
                  per_layer_input_size=per_layer,
                  per_layer_vocab_size=cfg["vocab_size_per_layer_input"] if per_layer else None, layer_scalar=True)


# -- Gemma-3n ------------------------------------------------------------------------------------------------
_GEMMA3N_TEXT_DEFAULTS = dict(
    vocab_size=262400, hidden_size=2048, intermediate_size=16384, num_hidden_layers=35, num_attention_heads=8,
    num_key_value_heads=2, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=32768,
    rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True, rope_parameters=None,
    attention_bias=False, sliding_window=512, layer_types=None, final_logit_softcapping=30.0,
    vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256, altup_active_idx=0, altup_coef_clip=120.0,
    altup_correct_scale=True, altup_num_inputs=4, num_kv_shared_layers=15, laurel_rank=64,
    activation_sparsity_pattern=None)


def _per_layer_values(cfg: _Fields, key: str, value: Any, n: int, kind: type | tuple[type, ...]) -> list:
    """A per-layer list of ``n`` values of ``kind`` (a single value: every layer's)."""
    values = list(value) if isinstance(value, list | tuple) else [value] * n
    if len(values) != n or not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{cfg.arch}: {key} must be one number or one per layer ({n}), got {value!r}")
    return values


@register("Gemma3nForCausalLM", "Gemma3nForConditionalGeneration")
def gemma3n(config: Mapping[str, Any]) -> HybridConfig:
    """Gemma-3n's text decoder (``Gemma3nTextModel``): Gemma-4's attention (q/k RMS norms with a weight, a weightless
    value norm, softmax scale 1, the last ``num_kv_shared_layers`` layers reading an earlier layer's KV cache) with
    one head dim, Gemma-3's RoPE per layer type (every 5th layer global by default), MLP widths per layer with
    activation sparsity on the first layers (``activation_sparsity_pattern``, default 0.95 on the first 10 of more
    than 10), per-layer inputs, ``altup_num_inputs`` AltUp streams, the Laurel branch (``laurel_rank``) and the
    final softcap. Norms scale by w. ``altup_coef_clip`` is a training-time clamp (HF's inference ignores it)."""
    arch = architecture_of(config)
    cfg = _Fields(arch, _text_part(config), _GEMMA3N_TEXT_DEFAULTS)
    n = cfg["num_hidden_layers"]
    types = cfg["layer_types"] or ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(n)]
    types = _check_layer_types(arch, types[:n], _GEMMA_LAYER_TYPES, count=n)
    widths = _per_layer_values(cfg, "intermediate_size", cfg["intermediate_size"], n, int)
    sparsity = cfg["activation_sparsity_pattern"]
    if sparsity is None:
        sparse = 10 if n > 10 else 0
        sparsity = [0.95] * sparse + [0.0] * (n - sparse)
    sparsity = [float(s) for s in _per_layer_values(cfg, "activation_sparsity_pattern", sparsity, n, (float, int))]
    ropes = _gemma3_ropes(cfg)
    donors = _kv_donors(arch, types, cfg["num_kv_shared_layers"])
    act = _activation(cfg["hidden_activation"], arch)
    layers = []
    for i, kind in enumerate(types):
        attention = Attention(
            num_heads=cfg["num_attention_heads"], num_kv_heads=cfg.kv_heads(), head_dim=cfg["head_dim"],
            sliding_window=cfg["sliding_window"] if kind == "sliding_attention" else None, rope=ropes[kind],
            qk_norm="rms", scale=1.0, qkv_bias=cfg["attention_bias"], o_bias=cfg["attention_bias"],
            value_norm=donors[i] is None, kv_source=donors[i])
        mlp = MLP(intermediate_size=widths[i], activation=act, activation_sparsity=sparsity[i])
        layers.append(Layer(mixer=attention, ffn=mlp, sandwich_norm=True))
    per_layer = cfg["hidden_size_per_layer_input"] or 0
    final_softcap = cfg["final_logit_softcapping"]
    outer = config if cfg.raw is not config else None
    tie = config.get("tie_word_embeddings", True) if outer is not None else cfg["tie_word_embeddings"]
    altup = AltUp(num_inputs=cfg["altup_num_inputs"], active_index=cfg["altup_active_idx"],
                  correct_scale=bool(cfg["altup_correct_scale"]))
    return _model(cfg, layers, outer=outer, norm="rms", norm_eps=cfg["rms_norm_eps"],
                  embedding_multiplier=float(cfg["hidden_size"]) ** 0.5,
                  final_softcap=float(final_softcap) if final_softcap else None, tie_word_embeddings=bool(tie),
                  per_layer_input_size=per_layer,
                  per_layer_vocab_size=cfg["vocab_size_per_layer_input"] if per_layer else None,
                  altup=altup, laurel_rank=cfg["laurel_rank"] or 0)


# -- Sliding-window hybrids: Cohere2 (Command-R7B), Exaone-4, Granite-SWA, GraniteMoE-SWA ------------------
_SLIDING_LAYER_TYPES = ("sliding_attention", "full_attention")


def _sliding_types(cfg: _Fields, default: Callable[[int], str]) -> list[str]:
    """``layer_types`` (one per layer, checked), else ``default(i)`` for each layer i."""
    n = cfg["num_hidden_layers"]
    types = cfg["layer_types"] or [default(i) for i in range(n)]
    if len(types) < n:
        raise ValueError(f"{cfg.arch}: layer_types has {len(types)} entries for {n} layers")
    return _check_layer_types(cfg.arch, types[:n], _SLIDING_LAYER_TYPES)


_COHERE2_DEFAULTS = dict(
    vocab_size=256000, hidden_size=8192, intermediate_size=22528, logit_scale=0.0625, num_hidden_layers=40,
    num_attention_heads=64, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=8192,
    layer_norm_eps=1e-5, bos_token_id=5, eos_token_id=255001, tie_word_embeddings=True, attention_bias=False,
    sliding_window=4096, sliding_window_pattern=4, layer_types=None)


@register("Cohere2ForCausalLM")
def cohere2(config: Mapping[str, Any]) -> HybridConfig:
    """Command-R7B: every ``sliding_window_pattern``-th layer global (``layer_types`` when given); sliding layers
    rotate (interleaved pairs, as GPT-J), global ones are NoPE; one bias-free LayerNorm feeds attention and MLP
    side by side (``parallel_ffn``); head_dim is always hidden / heads (HF ignores ``head_dim``); logits scaled by
    ``logit_scale``; ``attention_bias`` biases q, k, v and o."""
    cfg = _Fields("Cohere2ForCausalLM", config, _COHERE2_DEFAULTS)
    pattern = cfg["sliding_window_pattern"]
    types = _sliding_types(cfg, lambda i: "sliding_attention" if (i + 1) % pattern else "full_attention")
    rope = _rope(_rope_params(cfg), theta=10000.0, interleaved=True)
    heads, bias = cfg["num_attention_heads"], cfg["attention_bias"]
    mlp = MLP(intermediate_size=cfg["intermediate_size"], activation=_activation(cfg["hidden_act"], cfg.arch))
    layers = []
    for kind in types:
        sliding = kind == "sliding_attention"
        attention = Attention(num_heads=heads, num_kv_heads=cfg.kv_heads(), head_dim=cfg["hidden_size"] // heads,
                              sliding_window=cfg["sliding_window"] if sliding else None,
                              rope=rope if sliding else None, qkv_bias=bias, o_bias=bias)
        layers.append(Layer(mixer=attention, ffn=mlp, parallel_ffn=True))
    return _model(cfg, layers, norm="layer", norm_eps=cfg["layer_norm_eps"],
                  logits_multiplier=float(cfg["logit_scale"]))


_EXAONE4_DEFAULTS = dict(
    vocab_size=102400, hidden_size=4096, intermediate_size=16384, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, head_dim=None, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-5,
    bos_token_id=0, eos_token_id=2, tie_word_embeddings=False, sliding_window=4096, sliding_window_pattern=4,
    layer_types=None)


def _exaone4_sliding(cfg: _Fields) -> Callable[[int], str]:
    """The default layer type of layer i: every ``sliding_window_pattern``-th global when an int, or the
    pattern string repeated ("LLLG": L sliding, G global), as the released configs spell it."""
    pattern = cfg["sliding_window_pattern"]
    if isinstance(pattern, str):
        if not pattern or set(pattern) - {"L", "G"}:
            raise ValueError(f"{cfg.arch}: sliding_window_pattern {pattern!r} must be a string of L and G")
        return lambda i: "sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention"
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
        raise ValueError(f"{cfg.arch}: sliding_window_pattern must be a positive int or an L/G string, "
                         f"got {pattern!r}")
    return lambda i: "sliding_attention" if (i + 1) % pattern else "full_attention"


@register("Exaone4ForCausalLM")
def exaone4(config: Mapping[str, Any]) -> HybridConfig:
    """EXAONE-4.0: post-norms only (Olmo-2's layer: ``x += norm(attn(x)); x += norm(mlp(x))``), per-head q/k
    RMSNorms before RoPE; with a ``sliding_window`` the layers follow ``layer_types`` / the pattern and only the
    sliding ones rotate (global layers NoPE); without one every layer is global with RoPE (EXAONE-4.0-1.2B)."""
    cfg = _Fields("Exaone4ForCausalLM", config, _EXAONE4_DEFAULTS)
    window = cfg["sliding_window"]
    if window is None:
        types = ["full_attention"] * cfg["num_hidden_layers"]
    else:
        types = _sliding_types(cfg, _exaone4_sliding(cfg))
    rope = _rope(_rope_params(cfg), theta=10000.0)
    heads = cfg["num_attention_heads"]
    mlp = MLP(intermediate_size=cfg["intermediate_size"], activation=_activation(cfg["hidden_act"], cfg.arch))
    layers = []
    for kind in types:
        sliding = kind == "sliding_attention"
        attention = Attention(num_heads=heads, num_kv_heads=cfg.kv_heads(),
                              head_dim=cfg["head_dim"] or cfg["hidden_size"] // heads,
                              sliding_window=window if sliding else None,
                              rope=rope if sliding or window is None else None, qk_norm="rms")
        layers.append(Layer(mixer=attention, ffn=mlp, sandwich_norm=True, pre_norm=False))
    return _model(cfg, layers, norm_eps=cfg["rms_norm_eps"])


# Granite's µP multipliers (every Granite family): embeddings, residual branches, 1 / ``logits_scaling``.
def _granite_model(cfg: _Fields, layers: list[Layer]) -> HybridConfig:
    return _model(cfg, layers, norm_eps=cfg["rms_norm_eps"],
                  embedding_multiplier=float(cfg["embedding_multiplier"]),
                  residual_multiplier=float(cfg["residual_multiplier"]),
                  logits_multiplier=1.0 / float(cfg["logits_scaling"]))


def _granite_moe(cfg: _Fields, activation: str) -> MoE:
    """GraniteMoE's block: softmax over the top-k router logits (= softmax top-k renormalised), gated experts,
    and the shared gated MLP beside them when ``shared_intermediate_size`` > 0."""
    return MoE(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
               intermediate_size=cfg["intermediate_size"], router="softmax", renormalize=True,
               shared_intermediate_size=cfg["shared_intermediate_size"], activation=activation)


def _granite_swa_layers(cfg: _Fields, ffn: MLP | MoE) -> list[Layer]:
    """Granite-SWA's attention, one per layer before ``ffn``: sliding-window layers per ``layer_types`` (else every
    fourth layer from layer 0 global), a learned sink logit per head (gpt-oss's), softmax scale
    ``attention_multiplier``, and ``layer_rope_theta`` giving each layer its RoPE base (0: NoPE)."""
    n = cfg["num_hidden_layers"]
    types = _sliding_types(cfg, lambda i: "full_attention" if i % 4 == 0 else "sliding_attention")
    params = _rope_params(cfg)
    thetas = cfg["layer_rope_theta"] or [params.get("rope_theta", 10000.0)] * n
    if len(thetas) < n:
        raise ValueError(f"{cfg.arch}: layer_rope_theta has {len(thetas)} entries for {n} layers")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    bias = cfg["attention_bias"]
    layers = []
    for kind, theta in zip(types, thetas[:n], strict=True):
        attention = Attention(
            num_heads=heads, num_kv_heads=cfg.kv_heads(), head_dim=cfg["head_dim"] or hidden // heads,
            sliding_window=cfg["sliding_window"] if kind == "sliding_attention" else None,
            rope=_rope({**params, "rope_theta": theta}, theta=10000.0) if theta else None,
            scale=float(cfg["attention_multiplier"]), qkv_bias=bias, o_bias=bias, sinks=True)
        layers.append(Layer(mixer=attention, ffn=ffn))
    return layers


_GRANITE_SWA_DEFAULTS = dict(
    vocab_size=100352, hidden_size=2560, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=20,
    num_key_value_heads=4, head_dim=None, hidden_act="silu", max_position_embeddings=8192, rms_norm_eps=1e-5,
    bos_token_id=100257, eos_token_id=100257, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
    embedding_multiplier=1.0, logits_scaling=1.0, residual_multiplier=1.0, attention_multiplier=1.0,
    sliding_window=128, layer_types=None, layer_rope_theta=None)


@register("GraniteSWAForCausalLM")
def granite_swa(config: Mapping[str, Any]) -> HybridConfig:
    """Granite (µP multipliers: embeddings, residual branches, 1 / ``logits_scaling`` on the logits, softmax scale
    ``attention_multiplier``) with sliding-window layers (``layer_types``, else every fourth layer from layer 0
    global) and a learned sink logit per head (gpt-oss's); ``layer_rope_theta`` gives each layer its RoPE base,
    0 for NoPE."""
    cfg = _Fields("GraniteSWAForCausalLM", config, _GRANITE_SWA_DEFAULTS)
    mlp = MLP(intermediate_size=cfg["intermediate_size"], activation=_activation(cfg["hidden_act"], cfg.arch),
              bias=cfg["mlp_bias"])
    return _granite_model(cfg, _granite_swa_layers(cfg, mlp))


# HF's GraniteMoeSWAConfig defaults (GraniteMoeShared's, shared experts off); ``head_dim`` is not a field of it,
# but HF's attention reads one when a config carries it.
_GRANITEMOE_SWA_DEFAULTS = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=None, head_dim=None, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, attention_bias=False, embedding_multiplier=1.0,
    logits_scaling=1.0, residual_multiplier=1.0, attention_multiplier=1.0, num_local_experts=8,
    num_experts_per_tok=2, shared_intermediate_size=0, sliding_window=128, layer_types=None, layer_rope_theta=None)


@register("GraniteMoeSWAForCausalLM")
def granitemoe_swa(config: Mapping[str, Any]) -> HybridConfig:
    """GraniteMoE-SWA: Granite-SWA's attention (sliding / global per layer, sinks, a RoPE base per layer, µP
    multipliers) with GraniteMoeShared's feed-forward on every layer: ``num_local_experts`` routed experts (softmax
    over the top-k logits) plus, when ``shared_intermediate_size`` > 0 (default 0: off), the shared gated MLP."""
    cfg = _Fields("GraniteMoeSWAForCausalLM", config, _GRANITEMOE_SWA_DEFAULTS)
    moe = _granite_moe(cfg, _activation(cfg["hidden_act"], cfg.arch))
    return _granite_model(cfg, _granite_swa_layers(cfg, moe))


# -- Mamba2 (Mamba-Codestral) ------------------------------------------------------------------------------
_MAMBA2_DEFAULTS = dict(
    num_heads=128, head_dim=64, vocab_size=32768, hidden_size=4096, state_size=128, num_hidden_layers=64,
    layer_norm_epsilon=1e-5, bos_token_id=0, eos_token_id=2, expand=2, conv_kernel=4, n_groups=8,
    use_bias=False, use_conv_bias=True, hidden_act="silu", residual_in_fp32=True,
    time_step_limit=(0.0, _INF), chunk_size=256, tie_word_embeddings=False, max_position_embeddings=None)


@register("Mamba2ForCausalLM")
def mamba2(config: Mapping[str, Any]) -> HybridConfig:
    """A stack of Mamba2 blocks (no feed-forward); the residual stream in fp32 as HF's
    ``residual_in_fp32``. No position limit, so ``max_position_embeddings`` is a planning default."""
    cfg = _Fields("Mamba2ForCausalLM", config, _MAMBA2_DEFAULTS)
    _check_silu(cfg, "hidden_act")
    intermediate = cfg["expand"] * cfg["hidden_size"]
    heads, head_dim = _mamba_heads(cfg, intermediate, "num_heads", "head_dim")
    mixer = Mamba2(num_heads=heads, head_dim=head_dim, state_size=cfg["state_size"], n_groups=cfg["n_groups"],
                   conv_kernel=cfg["conv_kernel"], chunk_size=cfg["chunk_size"],
                   time_step_limit=_time_step_limit(cfg["time_step_limit"]), conv_bias=cfg["use_conv_bias"],
                   proj_bias=cfg["use_bias"], norm_eps=cfg["layer_norm_epsilon"])
    return _model(cfg, [Layer(mixer=mixer)] * cfg["num_hidden_layers"], norm_eps=cfg["layer_norm_epsilon"],
                  residual_in_fp32=bool(cfg["residual_in_fp32"]),
                  max_position_embeddings=cfg["max_position_embeddings"] or UNBOUNDED_POSITIONS)


# -- Bamba -------------------------------------------------------------------------------------------------
_BAMBA_DEFAULTS = dict(
    vocab_size=128000, tie_word_embeddings=False, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu", rms_norm_eps=1e-5,
    bos_token_id=1, eos_token_id=2, max_position_embeddings=262144, attn_layer_indices=None,
    mamba_n_heads=128, mamba_d_head="auto", mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4,
    mamba_expand=2, mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False,
    time_step_limit=(0.0, _INF), attention_bias=False, mlp_bias=False)


@register("BambaForCausalLM")
def bamba(config: Mapping[str, Any]) -> HybridConfig:
    """Mamba2 layers except ``attn_layer_indices`` (full attention, RoPE on the first half of each head:
    HF hard-codes partial_rotary_factor 0.5); every layer has a gated MLP."""
    cfg = _Fields("BambaForCausalLM", config, _BAMBA_DEFAULTS)
    n = cfg["num_hidden_layers"]
    attn_layers = set(cfg["attn_layer_indices"] or ())
    if bad := sorted(i for i in attn_layers if not 0 <= i < n):
        raise ValueError(f"{cfg.arch}: attn_layer_indices {bad} outside the {n} layers")
    _check_silu(cfg, "hidden_act")
    hidden = cfg["hidden_size"]
    heads, head_dim = _mamba_heads(cfg, cfg["mamba_expand"] * hidden, "mamba_n_heads", "mamba_d_head")
    mamba = Mamba2(num_heads=heads, head_dim=head_dim, state_size=cfg["mamba_d_state"],
                   n_groups=cfg["mamba_n_groups"], conv_kernel=cfg["mamba_d_conv"],
                   chunk_size=cfg["mamba_chunk_size"],
                   time_step_limit=_time_step_limit(cfg["time_step_limit"]),
                   conv_bias=cfg["mamba_conv_bias"], proj_bias=cfg["mamba_proj_bias"],
                   norm_eps=cfg["rms_norm_eps"])
    rope_params = _rope_params(cfg)
    attention = Attention(num_heads=cfg["num_attention_heads"], num_kv_heads=cfg.kv_heads(),
                          head_dim=cfg.get("head_dim") or hidden // cfg["num_attention_heads"],
                          rope=_rope(rope_params, theta=10000.0,
                                     partial_rotary_factor=rope_params.get("partial_rotary_factor", 0.5)),
                          qkv_bias=cfg["attention_bias"], o_bias=cfg["attention_bias"])
    mlp = MLP(intermediate_size=cfg["intermediate_size"], activation=_activation(cfg["hidden_act"], cfg.arch),
              bias=cfg["mlp_bias"])
    layers = [Layer(mixer=attention if i in attn_layers else mamba, ffn=mlp) for i in range(n)]
    return _model(cfg, layers, norm_eps=cfg["rms_norm_eps"])


# -- Jamba -------------------------------------------------------------------------------------------------
_JAMBA_DEFAULTS = dict(
    vocab_size=65536, tie_word_embeddings=False, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu", rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, max_position_embeddings=262144, num_experts_per_tok=2, num_experts=16,
    expert_layer_period=2, expert_layer_offset=1, attn_layer_period=8, attn_layer_offset=4,
    mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank="auto", mamba_conv_bias=True,
    mamba_proj_bias=False)


@register("JambaForCausalLM")
def jamba(config: Mapping[str, Any]) -> HybridConfig:
    """Attention (NoPE, full) at ``i % attn_layer_period == attn_layer_offset``, Mamba-1 with RMS norms on
    dt, B and C elsewhere; softmax top-k MoE (weights not renormalised) at the expert period/offset."""
    cfg = _Fields("JambaForCausalLM", config, _JAMBA_DEFAULTS)
    for what in ("attn", "expert"):
        if cfg[f"{what}_layer_offset"] >= cfg[f"{what}_layer_period"]:
            raise ValueError(f"{cfg.arch}: {what}_layer_offset must be smaller than {what}_layer_period")
    _check_silu(cfg, "hidden_act")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    num_experts = cfg.first("num_experts", "num_local_experts")
    dt_rank = cfg["mamba_dt_rank"]
    mamba = Mamba1(intermediate_size=cfg["mamba_expand"] * hidden, state_size=cfg["mamba_d_state"],
                   dt_rank=math.ceil(hidden / 16) if dt_rank == "auto" else dt_rank,
                   conv_kernel=cfg["mamba_d_conv"], dt_norm=True, conv_bias=cfg["mamba_conv_bias"],
                   proj_bias=cfg["mamba_proj_bias"], norm_eps=cfg["rms_norm_eps"])
    attention = Attention(num_heads=heads, num_kv_heads=cfg.kv_heads(), head_dim=hidden // heads, rope=None)
    act = _activation(cfg["hidden_act"], cfg.arch)
    mlp = MLP(intermediate_size=cfg["intermediate_size"], activation=act)
    moe = MoE(num_experts=num_experts, top_k=cfg["num_experts_per_tok"],
              intermediate_size=cfg["intermediate_size"], router="softmax", renormalize=False,
              activation=act) if num_experts > 1 else mlp
    layers = [Layer(mixer=attention if i % cfg["attn_layer_period"] == cfg["attn_layer_offset"] else mamba,
                    ffn=moe if i % cfg["expert_layer_period"] == cfg["expert_layer_offset"] else mlp)
              for i in range(cfg["num_hidden_layers"])]
    return _model(cfg, layers, norm_eps=cfg["rms_norm_eps"])


# -- Zamba2 ------------------------------------------------------------------------------------------------
_ZAMBA2_DEFAULT_TYPES = (["mamba"] + (["mamba"] * 5 + ["hybrid"]) * 7 + ["mamba"] * 4 + ["hybrid"]
                         + ["mamba"] * 3 + ["hybrid"] + ["mamba"] * 2)
_ZAMBA2_DEFAULTS = dict(
    vocab_size=32000, max_position_embeddings=4096, hidden_size=2560, layers_block_type=None,
    mamba_d_state=64, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1, time_step_min=0.001, n_mamba_heads=8,
    mamba_headdim="auto",
    chunk_size=256, add_bias_linear=False, intermediate_size=None, hidden_act="gelu",
    num_attention_heads=32, num_key_value_heads=None, num_mem_blocks=1, use_shared_attention_adapter=False,
    adapter_rank=128, use_mem_rope=False, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    use_long_context=False, tie_word_embeddings=True)


@register("Zamba2ForCausalLM")
def zamba2(config: Mapping[str, Any]) -> HybridConfig:
    """Every layer is Mamba2; "hybrid" layers first run a shared transformer block on
    concat(hidden, embeddings). Uses cycle through ``num_mem_blocks`` weight sets, each keeps its own KV
    cache; attention heads are 2 * hidden / heads wide, scaled by (head_dim / 2) ** -0.5 as in HF."""
    cfg = _Fields("Zamba2ForCausalLM", config, _ZAMBA2_DEFAULTS)
    types = [{"linear_attention": "mamba"}.get(t, t)
             for t in cfg["layers_block_type"] or _ZAMBA2_DEFAULT_TYPES]
    types = _check_layer_types(cfg.arch, types, ("mamba", "hybrid"))
    if cfg.get("num_hidden_layers", len(types)) != len(types):
        raise ValueError(f"{cfg.arch}: num_hidden_layers={cfg['num_hidden_layers']} but "
                         f"layers_block_type has {len(types)} entries")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = 2 * hidden // heads
    heads_m, head_dim_m = _mamba_heads(cfg, cfg["mamba_expand"] * hidden, "n_mamba_heads", "mamba_headdim")
    mamba = Mamba2(num_heads=heads_m, head_dim=head_dim_m, state_size=cfg["mamba_d_state"],
                   n_groups=cfg["mamba_ngroups"], conv_kernel=cfg["mamba_d_conv"],
                   chunk_size=cfg["chunk_size"],
                   time_step_limit=(float(cfg["time_step_min"]), _INF), conv_bias=True,
                   proj_bias=cfg["add_bias_linear"], norm_eps=1e-5)
    rope = _rope(_rope_params(cfg), theta=10000.0) if cfg["use_mem_rope"] else None
    mlp = MLP(intermediate_size=cfg["intermediate_size"] or 4 * hidden,
              activation=_activation(cfg["hidden_act"], cfg.arch), bias=cfg["add_bias_linear"])
    layers, uses = [], 0
    for kind in types:
        block = None
        if kind == "hybrid":
            block_id = uses % cfg["num_mem_blocks"]
            attention = Attention(num_heads=heads, num_kv_heads=cfg.kv_heads(), head_dim=head_dim, rope=rope,
                                  scale=(head_dim / 2) ** -0.5, shared_id=block_id)
            block = SharedBlock(block_id=block_id, use_index=uses, attention=attention, mlp=mlp,
                                adapter_rank=cfg["adapter_rank"],
                                attention_adapters=bool(cfg["use_shared_attention_adapter"]))
            uses += 1
        layers.append(Layer(mixer=mamba, shared_block=block))
    max_positions = 16384 if cfg["use_long_context"] else cfg["max_position_embeddings"]
    return _model(cfg, layers, norm_eps=cfg["rms_norm_eps"], max_position_embeddings=max_positions)


# -- NemotronH ---------------------------------------------------------------------------------------------
_NEMOTRON_H_DEFAULTS = dict(
    vocab_size=131072, hidden_size=4096, layers_block_type=None, tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2, num_attention_heads=32, num_key_value_heads=8, head_dim=None,
    max_position_embeddings=4096, intermediate_size=21504, mlp_hidden_act="relu2", mlp_bias=False,
    ssm_state_size=128, mamba_num_heads=128, mamba_head_dim=64, mamba_hidden_act="silu", n_groups=8,
    conv_kernel=4, time_step_min=0.001, use_conv_bias=True, chunk_size=128, n_routed_experts=8,
    moe_intermediate_size=7688, moe_shared_expert_intermediate_size=7688, moe_latent_size=None,
    num_experts_per_tok=2, routed_scaling_factor=1.0, n_group=1, topk_group=1, norm_topk_prob=True,
    use_bias=False, layer_norm_epsilon=1e-5)
_NEMOTRON_H_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_NEMOTRON_H_ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel",
                       "mamba_dt_min": "time_step_min", "mamba_conv_bias": "use_conv_bias",
                       "mamba_chunk_size": "chunk_size"}


def _nemotron_h_types(cfg: _Fields) -> list[str]:
    if cfg["layers_block_type"]:
        types = [{"mamba": "linear_attention", "attention": "full_attention"}.get(t, t)
                 for t in cfg["layers_block_type"]]
        return _check_layer_types(cfg.arch, types, _NEMOTRON_H_PATTERN.values())
    pattern = cfg.get("hybrid_override_pattern")
    if pattern is None:
        return ["linear_attention", "moe", "full_attention", "mlp"]
    for i, char in enumerate(pattern):
        if char not in _NEMOTRON_H_PATTERN:
            raise ValueError(f"{cfg.arch}: layer {i} has unknown hybrid_override_pattern character {char!r} "
                             f"(expected one of {''.join(_NEMOTRON_H_PATTERN)})")
    return [_NEMOTRON_H_PATTERN[char] for char in pattern]


@register("NemotronHForCausalLM")
def nemotron_h(config: Mapping[str, Any]) -> HybridConfig:
    """One part per layer (``hybrid_override_pattern``: M mamba, * attention, - MLP, E MoE), each with one
    pre-norm and a residual. Attention is NoPE without biases; MLPs are relu² and ungated; Mamba's dt is
    clamped below at ``time_step_min`` (HF's modeling, whatever ``time_step_limit`` says). Multi-token
    prediction layers are not part of the decoder."""
    renamed = dict(config)
    for old, new in _NEMOTRON_H_ALIASES.items():       # as in HF, an old spelling wins over the new one
        if old in config:
            renamed[new] = config[old]
    cfg = _Fields("NemotronHForCausalLM", renamed, _NEMOTRON_H_DEFAULTS)
    _check_silu(cfg, "mamba_hidden_act")
    act = _activation(cfg["mlp_hidden_act"], cfg.arch)
    mamba = Mamba2(num_heads=cfg["mamba_num_heads"], head_dim=cfg["mamba_head_dim"],
                   state_size=cfg["ssm_state_size"], n_groups=cfg["n_groups"], conv_kernel=cfg["conv_kernel"],
                   chunk_size=cfg["chunk_size"], time_step_limit=(float(cfg["time_step_min"]), _INF),
                   conv_bias=cfg["use_conv_bias"], proj_bias=cfg["use_bias"],
                   norm_eps=cfg["layer_norm_epsilon"])
    attention = Attention(num_heads=cfg["num_attention_heads"], num_kv_heads=cfg.kv_heads(),
                          head_dim=cfg.first("head_dim", "attention_head_dim", default=128), rope=None)
    parts: dict[str, Callable[[], Layer]] = {
        "linear_attention": lambda: Layer(mixer=mamba),
        "full_attention": lambda: Layer(mixer=attention),
        "mlp": lambda: Layer(ffn=MLP(intermediate_size=cfg["intermediate_size"], activation=act, gated=False,
                                     bias=cfg["mlp_bias"])),
        "moe": lambda: Layer(ffn=MoE(
            num_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"],
            intermediate_size=cfg["moe_intermediate_size"], router="sigmoid_bias",
            renormalize=bool(cfg["norm_topk_prob"]),
            shared_intermediate_size=cfg["moe_shared_expert_intermediate_size"],
            routed_scaling_factor=float(cfg["routed_scaling_factor"]), activation=act, gated=False,
            num_groups=cfg["n_group"], topk_groups=cfg["topk_group"], latent_size=cfg["moe_latent_size"])),
    }
    return _model(cfg, [parts[kind]() for kind in _nemotron_h_types(cfg)],
                  norm_eps=cfg["layer_norm_epsilon"])


# -- Falcon-H1 ---------------------------------------------------------------------------------------------
_FALCON_H1_DEFAULTS = dict(
    vocab_size=128000, tie_word_embeddings=False, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu", rms_norm_eps=1e-5,
    bos_token_id=1, eos_token_id=2, max_position_embeddings=8192, mamba_d_ssm=1024, mamba_n_heads=128,
    mamba_d_head="auto", mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4, mamba_expand=2,
    mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False, mamba_norm_before_gate=True,
    mamba_rms_norm=False, time_step_limit=(0.0, _INF), projectors_bias=False, lm_head_multiplier=1.0,
    embedding_multiplier=1.0, mlp_multipliers=None, key_multiplier=1.0, attention_out_multiplier=1.0,
    attention_in_multiplier=1.0, ssm_multipliers=None, ssm_in_multiplier=1.0, ssm_out_multiplier=1.0,
    attention_bias=False, mlp_bias=False)


@register("FalconH1ForCausalLM")
def falcon_h1(config: Mapping[str, Any]) -> HybridConfig:
    """Every layer runs attention and Mamba2 side by side on the same normed input (outputs summed),
    then a gated MLP; µP multipliers on embeddings, attention, SSM, MLP and logits."""
    cfg = _Fields("FalconH1ForCausalLM", config, _FALCON_H1_DEFAULTS)
    _check_silu(cfg, "hidden_act")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    inner = cfg["mamba_d_ssm"] if cfg["mamba_d_ssm"] is not None else cfg["mamba_expand"] * hidden
    heads_m, head_dim_m = _mamba_heads(cfg, inner, "mamba_n_heads", "mamba_d_head")
    gate_mult, down_mult = cfg["mlp_multipliers"] or (1.0, 1.0)
    mamba = Mamba2(num_heads=heads_m, head_dim=head_dim_m, state_size=cfg["mamba_d_state"],
                   n_groups=cfg["mamba_n_groups"], conv_kernel=cfg["mamba_d_conv"],
                   chunk_size=cfg["mamba_chunk_size"],
                   time_step_limit=_time_step_limit(cfg["time_step_limit"]),
                   conv_bias=cfg["mamba_conv_bias"], proj_bias=cfg["mamba_proj_bias"],
                   out_proj_bias=cfg["projectors_bias"], norm_eps=cfg["rms_norm_eps"],
                   gated_norm=bool(cfg["mamba_rms_norm"]),
                   norm_before_gate=bool(cfg["mamba_norm_before_gate"]),
                   input_multiplier=float(cfg["ssm_in_multiplier"]),
                   zxbcdt_multipliers=tuple(float(m) for m in cfg["ssm_multipliers"] or (1.0,) * 5),
                   output_multiplier=float(cfg["ssm_out_multiplier"]))
    attention = Attention(num_heads=heads, num_kv_heads=cfg.kv_heads(),
                          head_dim=cfg.get("head_dim") or hidden // heads,
                          rope=_rope(_rope_params(cfg), theta=10000.0), qkv_bias=cfg["attention_bias"],
                          o_bias=cfg["attention_bias"],
                          input_multiplier=float(cfg["attention_in_multiplier"]),
                          key_multiplier=float(cfg["key_multiplier"]),
                          output_multiplier=float(cfg["attention_out_multiplier"]))
    mlp = MLP(intermediate_size=cfg["intermediate_size"], activation=_activation(cfg["hidden_act"], cfg.arch),
              bias=cfg["mlp_bias"], gate_multiplier=float(gate_mult), down_multiplier=float(down_mult))
    layer = Layer(mixer=attention, parallel_mixer=mamba, ffn=mlp)
    return _model(cfg, [layer] * cfg["num_hidden_layers"], norm_eps=cfg["rms_norm_eps"],
                  embedding_multiplier=float(cfg["embedding_multiplier"]),
                  logits_multiplier=float(cfg["lm_head_multiplier"]))


# -- Granite-4.0-H (GraniteMoeHybrid) ----------------------------------------------------------------------
_GRANITE_DEFAULTS = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, attention_bias=False, embedding_multiplier=1.0,
    logits_scaling=1.0, residual_multiplier=1.0, attention_multiplier=1.0, num_local_experts=8,
    num_experts_per_tok=2, shared_intermediate_size=1024, position_embedding_type=None, layer_types=None,
    mamba_n_heads=128, mamba_n_groups=1, mamba_d_state=256, mamba_d_head="auto", mamba_d_conv=4,
    mamba_expand=2, mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False,
    time_step_limit=(0.0, _INF))


@register("GraniteMoeHybridForCausalLM")
def granite_moe_hybrid(config: Mapping[str, Any]) -> HybridConfig:
    """``layer_types`` picks Mamba2 or attention (NoPE unless ``position_embedding_type`` is "rope",
    softmax scale = ``attention_multiplier``); every layer has the shared MLP, plus routed experts (softmax
    over the top-k logits) when ``num_local_experts`` > 0; embedding/residual/logit multipliers."""
    cfg = _Fields("GraniteMoeHybridForCausalLM", config, _GRANITE_DEFAULTS)
    n = cfg["num_hidden_layers"]
    legacy = {"mamba": "linear_attention", "attention": "full_attention"}
    types = [legacy.get(t, t) for t in cfg["layer_types"] or ["linear_attention"] * n]
    types = _check_layer_types(cfg.arch, types, ("linear_attention", "full_attention"), count=n)
    _check_silu(cfg, "hidden_act")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    heads_m, head_dim_m = _mamba_heads(cfg, cfg["mamba_expand"] * hidden, "mamba_n_heads", "mamba_d_head")
    mamba = Mamba2(num_heads=heads_m, head_dim=head_dim_m, state_size=cfg["mamba_d_state"],
                   n_groups=cfg["mamba_n_groups"], conv_kernel=cfg["mamba_d_conv"],
                   chunk_size=cfg["mamba_chunk_size"],
                   time_step_limit=_time_step_limit(cfg["time_step_limit"]),
                   conv_bias=cfg["mamba_conv_bias"], proj_bias=cfg["mamba_proj_bias"],
                   norm_eps=cfg["rms_norm_eps"])
    rope = _rope(_rope_params(cfg), theta=10000.0) if cfg["position_embedding_type"] == "rope" else None
    attention = Attention(num_heads=heads, num_kv_heads=cfg.kv_heads(),
                          head_dim=cfg.get("head_dim") or hidden // heads, rope=rope,
                          scale=float(cfg["attention_multiplier"]), qkv_bias=cfg["attention_bias"],
                          o_bias=cfg["attention_bias"])
    act = _activation(cfg["hidden_act"], cfg.arch)
    ffn: MLP | MoE = (_granite_moe(cfg, act) if cfg["num_local_experts"] > 0
                      else MLP(intermediate_size=cfg["shared_intermediate_size"], activation=act))
    layers = [Layer(mixer=attention if kind == "full_attention" else mamba, ffn=ffn) for kind in types]
    return _granite_model(cfg, layers)


# -- gpt-oss -----------------------------------------------------------------------------------------------
_GPT_OSS_DEFAULTS = dict(
    num_hidden_layers=36, num_local_experts=128, vocab_size=201088, hidden_size=2880, intermediate_size=2880,
    head_dim=64, num_attention_heads=64, num_key_value_heads=8, sliding_window=128, tie_word_embeddings=False,
    max_position_embeddings=131072, rms_norm_eps=1e-5, num_experts_per_tok=4, swiglu_alpha=1.702,
    swiglu_limit=7.0, layer_types=None, bos_token_id=None, eos_token_id=None, attention_bias=True,
    quantization_config=None)
# HF's GptOssConfig when the config names no RoPE parameters.
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
_GPT_OSS_TYPES = ("sliding_attention", "full_attention")


@register("GptOssForCausalLM")
def gpt_oss(config: Mapping[str, Any]) -> HybridConfig:
    """Sliding-window (``sliding_window``, 128) and full attention alternating from a sliding layer 0 unless
    ``layer_types`` says otherwise; every layer has attention sinks, q/k/v/o biases (``attention_bias``),
    YaRN RoPE and a MoE of biased experts with the clamped SwiGLU (``swiglu_alpha`` / ``swiglu_limit``),
    routed by a softmax over the top-k logits of a biased router. ``hidden_act`` is not read (HF does not
    either). MXFP4 experts (``quantization_config.quant_method == "mxfp4"``, the released checkpoints) are
    dequantized at load (``loaders/families/gpt_oss.py``); other quantizations are refused. A config naming no
    dtype (the released ones) plans and loads as bfloat16, the dtype of its unquantized tensors."""
    cfg = _Fields("GptOssForCausalLM", config, _GPT_OSS_DEFAULTS)
    quant = cfg["quantization_config"]
    if quant is not None and (not isinstance(quant, Mapping) or quant.get("quant_method") != "mxfp4"):
        method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
        raise ValueError(f"{cfg.arch}: quantization_config.quant_method {method!r} is not supported (only the "
                         f"released checkpoints' mxfp4 experts, which load dequantized)")
    n = cfg["num_hidden_layers"]
    types = cfg["layer_types"] or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if len(types) < n:
        raise ValueError(f"{cfg.arch}: layer_types has {len(types)} entries for {n} layers")
    types = _check_layer_types(cfg.arch, types[:n], _GPT_OSS_TYPES)
    params = _rope_params(cfg) if (cfg.get("rope_scaling") or cfg.get("rope_parameters")) else dict(_GPT_OSS_ROPE)
    rope = _rope(params, theta=150000.0, max_positions=cfg["max_position_embeddings"])
    moe = MoE(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
              intermediate_size=cfg["intermediate_size"],
              router="topk_softmax", renormalize=False, router_bias=True, bias=True, activation="swiglu_oai",
              swiglu_alpha=float(cfg["swiglu_alpha"]), swiglu_limit=float(cfg["swiglu_limit"]))
    bias = bool(cfg["attention_bias"])
    layers = []
    for kind in types:
        attention = Attention(
            num_heads=cfg["num_attention_heads"], num_kv_heads=cfg.kv_heads(),
            head_dim=cfg["head_dim"] or cfg["hidden_size"] // cfg["num_attention_heads"],
            sliding_window=cfg["sliding_window"] if kind == "sliding_attention" else None, rope=rope,
            qkv_bias=bias, o_bias=bias, sinks=True)
        layers.append(Layer(mixer=attention, ffn=moe))
    named = cfg.raw.get("dtype") or cfg.raw.get("torch_dtype")
    return _model(cfg, layers, norm_eps=cfg["rms_norm_eps"], **({} if named else {"dtype": "bfloat16"}))


# -- LFM2 --------------------------------------------------------------------------------------------------
_LFM2_DEFAULTS = dict(
    vocab_size=65536, hidden_size=2560, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=128000, norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=True, conv_bias=False, conv_L_cache=3, block_multiple_of=256, block_ffn_dim_multiplier=1.0,
    block_auto_adjust_ff_dim=True, full_attn_idxs=None, layer_types=None)
_LFM2_TYPES = ("conv", "full_attention")


def _lfm2_layer_types(cfg: _Fields) -> list[str]:
    """``layer_types``, else "full_attention" at ``full_attn_idxs`` (every layer when that is null too, as
    HF's ``Lfm2Config``) and "conv" elsewhere."""
    n = cfg["num_hidden_layers"]
    if cfg["layer_types"] is not None:
        types = _check_layer_types(cfg.arch, cfg["layer_types"], _LFM2_TYPES, count=n)
        return types
    idxs = cfg["full_attn_idxs"]
    attention = set(range(n)) if idxs is None else set(idxs)
    if any(not isinstance(i, int) or not 0 <= i < n for i in attention):
        raise ValueError(f"{cfg.arch}: full_attn_idxs {sorted(idxs)!r} must be layer indices below {n}")
    return ["full_attention" if i in attention else "conv" for i in range(n)]


def _lfm2_ff_dim(cfg: _Fields) -> int:
    """HF ``Lfm2MLP``'s width: with ``block_auto_adjust_ff_dim``, 2/3 of the configured size, times
    ``block_ffn_dim_multiplier`` (when set) and rounded up to ``block_multiple_of``."""
    size = cfg["intermediate_size"]
    if cfg["block_auto_adjust_ff_dim"]:
        size = int(2 * size / 3)
        if cfg["block_ffn_dim_multiplier"] is not None:
            size = int(cfg["block_ffn_dim_multiplier"] * size)
            multiple = cfg["block_multiple_of"]
            size = multiple * ((size + multiple - 1) // multiple)
    return size


def _lfm2_mixers(cfg: _Fields, types: list[str]) -> list[Attention | ShortConv]:
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    attention = Attention(num_heads=heads, num_kv_heads=cfg.kv_heads(),
                          head_dim=cfg.get("head_dim") or hidden // heads,
                          rope=_rope(_rope_params(cfg), theta=1_000_000.0), qk_norm="rms")
    conv = ShortConv(channels=hidden, conv_kernel=cfg["conv_L_cache"], bias=bool(cfg["conv_bias"]))
    return [attention if kind == "full_attention" else conv for kind in types]


def _lfm2_renamed(config: Mapping[str, Any], *aliases: tuple[str, str]) -> dict[str, Any]:
    """The hub's older spellings win over the new keys, as in HF's config classes."""
    renamed = dict(config)
    for old, new in aliases:
        if old in config:
            renamed[new] = config[old]
    return renamed


@register("Lfm2ForCausalLM")
def lfm2(config: Mapping[str, Any]) -> HybridConfig:
    """Short-convolution layers (``ShortConv``, width ``conv_L_cache``) and full attention per ``layer_types``
    (or ``full_attn_idxs``), every layer with a SwiGLU MLP. Attention: RMS q/k norms per head before RoPE (theta
    1e6 by default), no biases; ``conv_bias`` biases the conv's projections and the conv. The hub's older
    spellings win as in HF: ``block_ff_dim`` over ``intermediate_size``, ``tie_embedding`` over
    ``tie_word_embeddings``. The final norm is HF's ``embedding_norm`` (applied after the last layer)."""
    cfg = _Fields("Lfm2ForCausalLM", _lfm2_renamed(config, ("block_ff_dim", "intermediate_size"),
                                                   ("tie_embedding", "tie_word_embeddings")), _LFM2_DEFAULTS)
    mlp = MLP(intermediate_size=_lfm2_ff_dim(cfg))
    return _model(cfg, [Layer(mixer=m, ffn=mlp) for m in _lfm2_mixers(cfg, _lfm2_layer_types(cfg))],
                  norm_eps=cfg["norm_eps"])


_LFM2_MOE_DEFAULTS = dict(
    vocab_size=65536, hidden_size=2048, intermediate_size=7168, moe_intermediate_size=1792, num_hidden_layers=32,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=True, max_position_embeddings=128000, norm_eps=1e-5,
    num_attention_heads=32, num_key_value_heads=8, conv_bias=False, conv_L_cache=3, num_dense_layers=2,
    num_experts_per_tok=4, num_experts=32, use_expert_bias=True, routed_scaling_factor=1.0, norm_topk_prob=True,
    layer_types=None)


@register("Lfm2MoeForCausalLM")
def lfm2_moe(config: Mapping[str, Any]) -> HybridConfig:
    """LFM2's layers (``layer_types`` is required, as HF's modeling reads it) with a dense SwiGLU MLP of
    ``intermediate_size`` (no width rule) in the first ``num_dense_layers`` layers and routed experts after:
    sigmoid scores, the top ``num_experts_per_tok`` chosen by score + ``expert_bias``, weights renormalised when
    ``norm_topk_prob`` and scaled by ``routed_scaling_factor`` (our ``sigmoid_bias`` router; HF adds 1e-6 to the
    renormalising sum, we 1e-20: a relative difference below 1e-6 of the weights). ``use_expert_bias=false`` is
    refused (no released checkpoint has it; it would need a router without the bias)."""
    cfg = _Fields("Lfm2MoeForCausalLM", _lfm2_renamed(config, ("tie_embedding", "tie_word_embeddings")),
                  _LFM2_MOE_DEFAULTS)
    if cfg["layer_types"] is None:
        raise ValueError(f"{cfg.arch}: config lacks layer_types")
    if not cfg["use_expert_bias"]:
        raise ValueError(f"{cfg.arch}: use_expert_bias=false is not supported (routing without the expert bias)")
    types = _lfm2_layer_types(cfg)
    dense = MLP(intermediate_size=cfg["intermediate_size"])
    moe = MoE(num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
              intermediate_size=cfg["moe_intermediate_size"], router="sigmoid_bias",
              renormalize=bool(cfg["norm_topk_prob"]), routed_scaling_factor=float(cfg["routed_scaling_factor"]))
    layers = [Layer(mixer=m, ffn=dense if i < cfg["num_dense_layers"] else moe)
              for i, m in enumerate(_lfm2_mixers(cfg, types))]
    return _model(cfg, layers, norm_eps=cfg["norm_eps"])


_QWEN3_NEXT_DEFAULTS = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48, num_attention_heads=16,
    num_key_value_heads=2, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
    tie_word_embeddings=False, attention_bias=False, head_dim=256, linear_conv_kernel_dim=4,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
    decoder_sparse_step=1, moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts_per_tok=10,
    num_experts=512, norm_topk_prob=True, mlp_only_layers=None, layer_types=None, full_attention_interval=4,
    partial_rotary_factor=0.25)
_QWEN3_NEXT_TYPES = ("linear_attention", "full_attention")


def _qwen3_next_mixers(cfg: _Fields) -> list[Attention | GatedDeltaNet]:
    """Qwen3-Next's and Qwen3.5's mixers: Gated DeltaNet (``linear_attention``) and gated full attention per
    ``layer_types``, else full attention every ``full_attention_interval``-th layer. ``hidden_act`` is also the
    DeltaNet conv's activation in HF, so only "silu" is accepted."""
    if cfg["hidden_act"] not in ("silu", "swish"):
        raise ValueError(f"{cfg.arch}: hidden_act {cfg['hidden_act']!r} is not supported (the DeltaNet conv and "
                         f"the MLPs use it; released checkpoints use 'silu')")
    n = cfg["num_hidden_layers"]
    if cfg["layer_types"] is not None:
        types = _check_layer_types(cfg.arch, cfg["layer_types"], _QWEN3_NEXT_TYPES, count=n)
    else:
        interval = cfg["full_attention_interval"]
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(f"{cfg.arch}: full_attention_interval must be a positive integer, got {interval!r}")
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    heads, bias = cfg["num_attention_heads"], bool(cfg["attention_bias"])
    rope = _rope(_rope_params(cfg), theta=10000.0, partial_rotary_factor=cfg["partial_rotary_factor"])
    attention = Attention(num_heads=heads, num_kv_heads=cfg.kv_heads(),
                          head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, rope=rope, qk_norm="rms",
                          qkv_bias=bias, o_bias=bias, output_gate=True)
    deltanet = GatedDeltaNet(num_k_heads=cfg["linear_num_key_heads"], num_v_heads=cfg["linear_num_value_heads"],
                             head_k_dim=cfg["linear_key_head_dim"], head_v_dim=cfg["linear_value_head_dim"],
                             conv_kernel=cfg["linear_conv_kernel_dim"], norm_eps=cfg["rms_norm_eps"])
    return [attention if kind == "full_attention" else deltanet for kind in types]


def _qwen3_next_moe(cfg: _Fields, *, renormalize: bool) -> MoE:
    """Routed experts (softmax top-k) with a sigmoid-gated shared expert."""
    return MoE(num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
               intermediate_size=cfg["moe_intermediate_size"], renormalize=renormalize,
               shared_intermediate_size=cfg["shared_expert_intermediate_size"], shared_gate=True)


@register("Qwen3NextForCausalLM")
def qwen3_next(config: Mapping[str, Any]) -> HybridConfig:
    """Gated DeltaNet (``linear_attention``) and gated full attention per ``layer_types`` (else full attention
    every ``full_attention_interval``-th layer, as HF's ``Qwen3NextConfig``). Attention: q_proj with a sigmoid
    output gate per head, zero-centred RMS q/k norms before a partial RoPE (``partial_rotary_factor``, 0.25 by
    default), ``attention_bias`` on all four projections. Every RMS norm but the DeltaNet's gated one scales by
    (1 + w) (``gemma_rms``). Feed-forward: routed experts (softmax top-k, renormalised when ``norm_topk_prob``) with
    a sigmoid-gated shared expert on layers i with (i + 1) % ``decoder_sparse_step`` == 0 outside
    ``mlp_only_layers``, a SwiGLU MLP of ``intermediate_size`` elsewhere. ``hidden_act`` is also the DeltaNet conv's
    activation in HF, so only "silu" is accepted; the multi-token-prediction head (``mtp.*``) is not served."""
    cfg = _Fields("Qwen3NextForCausalLM", config, _QWEN3_NEXT_DEFAULTS)
    mixers = _qwen3_next_mixers(cfg)
    dense = MLP(intermediate_size=cfg["intermediate_size"])
    experts, step = cfg["num_experts"], cfg["decoder_sparse_step"]
    if experts and (not isinstance(step, int) or step < 1):
        raise ValueError(f"{cfg.arch}: decoder_sparse_step must be a positive integer, got {step!r}")
    moe = _qwen3_next_moe(cfg, renormalize=bool(cfg["norm_topk_prob"])) if experts else None
    dense_only = set(cfg["mlp_only_layers"] or ())
    layers = [Layer(mixer=mixer, ffn=moe if moe is not None and i not in dense_only and (i + 1) % step == 0 else dense)
              for i, mixer in enumerate(mixers)]
    return _model(cfg, layers, norm="gemma_rms")


# -- Kimi-Linear ---------------------------------------------------------------------------------------------------
# HF's ``KimiLinearConfig`` defaults, under the hub's spellings (which its ``attribute_map`` and ``to_dict`` use).
_KIMI_LINEAR_DEFAULTS = dict(
    vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=27,
    num_attention_heads=32, num_key_value_heads=None, num_shared_experts=1, routed_scaling_factor=2.446,
    kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
    num_expert_group=1, topk_group=1, num_experts_per_token=8, moe_renormalize=True, hidden_act="silu",
    model_max_length=1048576, rms_norm_eps=1e-5, bos_token_id=163584, eos_token_id=163586, tie_word_embeddings=False,
    attention_bias=False, num_experts=256, mlp_layer_types=None, layer_types=None, linear_head_dim=128,
    linear_num_heads=32, linear_conv_kernel_dim=4, first_k_dense_replace=1,
    max_position_embeddings=None)             # read as model_max_length (see alias)
_KIMI_LINEAR_TYPES = ("linear_attention", "full_attention")
_KIMI_LINEAR_MLP_TYPES = ("dense", "sparse")


def _kimi_linear_layer_types(cfg: _Fields, linear: Mapping[str, Any]) -> list[str]:
    """HF's precedence: ``layer_types``, else the hub's 1-indexed ``linear_attn_config`` lists (``full_attn_layers``
    and ``kda_layers``, together covering every layer), else full attention on layers i > 0 with i % 4 == 0."""
    n = cfg["num_hidden_layers"]
    if cfg["layer_types"] is not None:
        types = _check_layer_types(cfg.arch, cfg["layer_types"], _KIMI_LINEAR_TYPES)
    elif "full_attn_layers" in linear and "kda_layers" in linear:
        types = [None] * n
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for number in linear[key]:
                if not isinstance(number, int) or not 1 <= number <= n:
                    raise ValueError(f"{cfg.arch}: linear_attn_config.{key} holds {number!r}, not a layer number "
                                     f"in 1..{n} (they count from 1)")
                types[number - 1] = kind
        missing = [i + 1 for i, kind in enumerate(types) if kind is None]
        if missing:
            raise ValueError(f"{cfg.arch}: linear_attn_config names no kind for layers {missing} (1-indexed)")
    else:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if len(types) != n:
        raise ValueError(f"{cfg.arch}: layer_types has {len(types)} entries for {n} layers")
    return types


@register("KimiLinearForCausalLM")
def kimi_linear(config: Mapping[str, Any]) -> HybridConfig:
    """Kimi Delta Attention (``linear_attention``) and NoPE multi-head latent attention (``full_attention``) per
    ``layer_types`` (or the hub's ``linear_attn_config``, see ``_kimi_linear_layer_types``); KDA's heads, head dim
    and conv width from ``linear_attn_config`` (``num_heads``, ``head_dim``, ``short_conv_kernel_size``) over the
    flat ``linear_*`` keys, as HF reads them. Feed-forward per ``mlp_layer_types`` (else dense on the first
    ``first_k_dense_replace`` layers): a SwiGLU MLP of ``intermediate_size``, or routed experts with a sigmoid router
    and correction bias (the ``sigmoid_bias`` router: group-limited selection, renormalised when
    ``moe_renormalize``, scaled by ``routed_scaling_factor``) plus an ungated shared expert of
    ``moe_intermediate_size * num_shared_experts``. Refused: an activation other than silu (it is also the KDA conv's
    in HF), a router other than sigmoid, MLA with RoPE (``mla_use_nope=false``: HF runs NoPE whatever the key says,
    which would silently differ from such a checkpoint) and num_key_value_heads != num_attention_heads (HF's MLA
    makes one key/value head per query head)."""
    cfg = _Fields("KimiLinearForCausalLM", config, _KIMI_LINEAR_DEFAULTS)

    def alias(hub: str, hf: str) -> Any:         # HF's attribute_map: either spelling, the hub's first
        return config[hub] if config.get(hub) is not None else config.get(hf, _KIMI_LINEAR_DEFAULTS[hub])

    if cfg["hidden_act"] not in ("silu", "swish"):
        raise ValueError(f"{cfg.arch}: hidden_act {cfg['hidden_act']!r} is not supported (the KDA conv and the "
                         f"MLPs use it; released checkpoints use 'silu')")
    if cfg.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise ValueError(f"{cfg.arch}: moe_router_activation_func {cfg['moe_router_activation_func']!r} is not "
                         f"supported (HF's router is a sigmoid)")
    if cfg.get("mla_use_nope", True) is False:
        raise ValueError(f"{cfg.arch}: mla_use_nope=false (MLA with RoPE) is not supported; HF's KimiLinear "
                         f"attention is NoPE")
    heads = cfg["num_attention_heads"]
    if cfg.kv_heads() != heads:
        raise ValueError(f"{cfg.arch}: num_key_value_heads={cfg.kv_heads()} must equal num_attention_heads={heads} "
                         f"(MLA expands its latent into one key/value head per query head)")
    linear = cfg.get("linear_attn_config") or {}
    if not isinstance(linear, Mapping):
        raise ValueError(f"{cfg.arch}: linear_attn_config must be an object, got {type(linear).__name__}")
    types = _kimi_linear_layer_types(cfg, linear)
    n = cfg["num_hidden_layers"]
    if cfg["mlp_layer_types"] is not None:
        mlp_types = _check_layer_types(cfg.arch, cfg["mlp_layer_types"], _KIMI_LINEAR_MLP_TYPES, count=n,
                                       key="mlp_layer_types")
    else:
        mlp_types = ["dense" if i < cfg["first_k_dense_replace"] else "sparse" for i in range(n)]
    kda = KimiDeltaAttention(num_heads=linear.get("num_heads", cfg["linear_num_heads"]),
                             head_dim=linear.get("head_dim", cfg["linear_head_dim"]),
                             conv_kernel=linear.get("short_conv_kernel_size", cfg["linear_conv_kernel_dim"]),
                             norm_eps=cfg["rms_norm_eps"])
    mla = MultiLatentAttention(num_heads=heads, kv_lora_rank=cfg["kv_lora_rank"], q_lora_rank=cfg["q_lora_rank"],
                               qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                               v_head_dim=cfg["v_head_dim"], bias=bool(cfg["attention_bias"]))
    dense = MLP(intermediate_size=cfg["intermediate_size"])
    moe = None
    if "sparse" in mlp_types:
        moe = MoE(num_experts=alias("num_experts", "num_local_experts"),
                  top_k=alias("num_experts_per_token", "num_experts_per_tok"),
                  intermediate_size=cfg["moe_intermediate_size"], router="sigmoid_bias",
                  renormalize=bool(alias("moe_renormalize", "norm_topk_prob")),
                  routed_scaling_factor=float(cfg["routed_scaling_factor"]),
                  num_groups=alias("num_expert_group", "n_group"), topk_groups=cfg["topk_group"],
                  shared_intermediate_size=cfg["moe_intermediate_size"]
                  * alias("num_shared_experts", "n_shared_experts"))
    layers = [Layer(mixer=mla if kind == "full_attention" else kda, ffn=moe if mlp == "sparse" else dense)
              for kind, mlp in zip(types, mlp_types, strict=True)]
    return _model(cfg, layers, norm_eps=cfg["rms_norm_eps"],
                  max_position_embeddings=alias("model_max_length", "max_position_embeddings"))
# HF's ``Qwen3_5TextConfig`` / ``Qwen3_5MoeTextConfig`` defaults (the 9B / 35B-A3B sizes). Neither has
# ``full_attention_interval`` as a field: HF's ``__post_init__`` reads it (default 4) when ``layer_types`` is absent.
_QWEN3_5_DEFAULTS = dict(
    _QWEN3_NEXT_DEFAULTS, vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
    num_key_value_heads=4)
_QWEN3_5_MOE_DEFAULTS = dict(
    _QWEN3_NEXT_DEFAULTS, vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_experts_per_tok=8,
    num_experts=256)


@register("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
          "Qwen3_5MoeForConditionalGeneration")
def qwen3_5(config: Mapping[str, Any]) -> HybridConfig:
    """Qwen3.5 (dense and MoE; the text part of the multimodal ``...ForConditionalGeneration``, its vision
    tower not served): Qwen3-Next's layers with the DeltaNet's projections unfused (``in_proj_qkv`` /
    ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``, stored as ``GatedDeltaNet`` holds them). The dense model has a
    SwiGLU MLP on every layer; the MoE model routed experts (softmax top-k, always renormalised) with a
    sigmoid-gated shared expert on every layer. HF's multimodal RoPE (``mrope_section``) gives text positions the
    same angle on each of its three axes, so on text it is the plain (partial) RoPE served here. The multimodal
    config's own ``tie_word_embeddings`` (default false) decides the tying, as HF's model reads it."""
    arch = architecture_of(config)
    moe = arch.startswith("Qwen3_5Moe")
    text = _text_part(config)
    cfg = _Fields(arch, text, _QWEN3_5_MOE_DEFAULTS if moe else _QWEN3_5_DEFAULTS)
    ffn = _qwen3_next_moe(cfg, renormalize=True) if moe else MLP(intermediate_size=cfg["intermediate_size"])
    layers = [Layer(mixer=mixer, ffn=ffn) for mixer in _qwen3_next_mixers(cfg)]
    outer = config if text is not config else None
    tie = config.get("tie_word_embeddings", False) if outer is not None else cfg["tie_word_embeddings"]
    return _model(cfg, layers, outer=outer, norm="gemma_rms", tie_word_embeddings=bool(tie))


# -- OLMo-Hybrid ---------------------------------------------------------------------------------------------
_OLMO_HYBRID_DEFAULTS = dict(
    vocab_size=100352, hidden_size=3840, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=30,
    num_key_value_heads=None, hidden_act="silu", max_position_embeddings=65536, rms_norm_eps=1e-6,
    bos_token_id=None, eos_token_id=100257, tie_word_embeddings=False, attention_bias=False, layer_types=None,
    linear_num_key_heads=None, linear_num_value_heads=None, linear_key_head_dim=None, linear_value_head_dim=None,
    linear_conv_kernel_dim=4, linear_allow_neg_eigval=True)


def _olmo_hybrid_types(cfg: _Fields) -> list[str]:
    """``layer_types``, else HF's default: full attention on every layer i with i % 4 == 3 (the last layer when
    that gives none); at least one layer of each kind, as HF's config requires."""
    n = cfg["num_hidden_layers"]
    if cfg["layer_types"] is not None:
        types = _check_layer_types(cfg.arch, cfg["layer_types"], _QWEN3_NEXT_TYPES, count=n)
    else:
        types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
        if "full_attention" not in types:
            types[-1] = "full_attention"
    if len(set(types)) != 2:
        raise ValueError(f"{cfg.arch}: needs at least one linear_attention and one full_attention layer (as HF's "
                         f"config checks), got {types}")
    return types


@register("OlmoHybridForCausalLM")
def olmo_hybrid(config: Mapping[str, Any]) -> HybridConfig:
    """OLMo-Hybrid: Gated DeltaNet (``linear_attention``) and OLMo-3 attention layers per ``layer_types``.
    DeltaNet layers are pre-norm (Llama's placement) with separate q / k / v / gate / b / a projections (our
    "flat" projections), beta scaled by 2 when ``linear_allow_neg_eigval``, a gated head norm of eps 1e-5 (fixed in
    HF's module); the linear heads default to the attention heads, the key head dim to 0.75 * hidden / key heads
    and the value head dim to twice that. Attention layers are post-norm only (OLMo-2/3: the attention and MLP
    outputs normed before they join the residual), with q and k each normed over all heads before RoPE, and
    head dim hidden / heads. RoPE: ``rope_theta`` (10000 by default); HF builds no rotary embedding when the
    config sets the theta to null, so those attention layers are NoPE."""
    cfg = _Fields("OlmoHybridForCausalLM", config, _OLMO_HYBRID_DEFAULTS)
    if cfg["hidden_act"] not in ("silu", "swish"):
        raise ValueError(f"{cfg.arch}: hidden_act {cfg['hidden_act']!r} is not supported (the DeltaNet conv and "
                         f"the MLPs use it; released checkpoints use 'silu')")
    types = _olmo_hybrid_types(cfg)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    params = _rope_params(cfg)
    nope = params.get("rope_theta") is None and ("rope_theta" in params or cfg.raw.get("rope_theta", 0) is None)
    bias = bool(cfg["attention_bias"])
    attention = Attention(num_heads=heads, num_kv_heads=cfg.kv_heads(), head_dim=hidden // heads,
                          rope=None if nope else _rope(params, theta=10000.0), qk_norm="rms_full", qkv_bias=bias,
                          o_bias=bias)
    k_heads = cfg["linear_num_key_heads"] or heads
    k_dim = cfg["linear_key_head_dim"] or int(0.75 * hidden / k_heads)
    deltanet = GatedDeltaNet(num_k_heads=k_heads, num_v_heads=cfg["linear_num_value_heads"] or heads,
                             head_k_dim=k_dim, head_v_dim=cfg["linear_value_head_dim"] or 2 * k_dim,
                             conv_kernel=cfg["linear_conv_kernel_dim"], norm_eps=1e-5,
                             beta_scale=2.0 if cfg["linear_allow_neg_eigval"] else 1.0)
    mlp = MLP(intermediate_size=cfg["intermediate_size"])
    layers = [Layer(mixer=attention, ffn=mlp, sandwich_norm=True, pre_norm=False) if kind == "full_attention"
              else Layer(mixer=deltanet, ffn=mlp) for kind in types]
    return _model(cfg, layers, norm_eps=cfg["rms_norm_eps"])
