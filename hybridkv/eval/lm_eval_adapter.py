"""hybridkv as an lm-evaluation-harness model named ``hybridkv``.

    lm_eval --model hybridkv --model_args pretrained=DIR,dtype=float32 --tasks hellaswag

``HybridKVEvaluator`` does the work on plain Python values (it never imports lm_eval, so it is usable and
testable without it): ``loglikelihood`` / ``loglikelihood_rolling`` read the engine's prompt log-probabilities
(``SamplingParams(prompt_logprobs=1)``: one prefill per sequence, no decoding), ``generate_until`` is one
batched ``generate``. Every method submits all its requests to the engine at once (or ``requests_per_call``
at a time), so continuous batching and chunked prefill do the batching.

``HybridKVLM``, the ``lm_eval.api.model.LM`` subclass, is built on first access (module ``__getattr__``), so
importing this module never imports lm_eval. lm-eval finds it through the ``lm_eval.models`` entry point
(lm-eval versions with plugin discovery) or after ``register()``; ``python -m hybridkv.eval.lm_eval_adapter``
is lm-eval's own command line with the model registered, for any lm-eval version.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from hybridkv import LLM, SamplingParams

logger = logging.getLogger("hybridkv.eval")

MODEL_NAME = "hybridkv"
DEFAULT_MAX_GEN_TOKS = 256


def rolling_windows(tokens: Sequence[int], prefix_token: int, max_len: int) -> list[tuple[list[int], list[int]]]:
    """lm-eval's disjoint rolling windows (context_len = 1): (context, targets) pairs in which every token is
    predicted exactly once, the first from ``prefix_token``, each with as much context as fits in
    ``max_len`` input tokens."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    tokens = list(tokens)
    if not tokens:
        return []
    windows = []
    first = min(max_len, len(tokens))
    windows.append(([prefix_token], tokens[:first]))
    done = first
    while done < len(tokens):
        n = min(len(tokens) - done, max_len)
        end = done + n
        inputs = tokens[max(0, end - max_len - 1):end - 1]        # max_len inputs ending before the last target
        windows.append((inputs[: len(inputs) - (n - 1)], tokens[end - n:end]))
        done = end
    return windows


class HybridKVEvaluator:
    """The three lm-eval request types on an ``LLM``. ``max_length``: longest sequence scored or prompted
    (default: the engine's ``max_model_len``); ``requests_per_call``: requests per ``generate`` call (None:
    all at once; the engine's ``max_num_seqs`` bounds how many run together either way)."""

    def __init__(self, llm: LLM, *, max_length: int | None = None, requests_per_call: int | None = None,
                 use_tqdm: bool = False) -> None:
        if llm.tokenizer is None:
            raise ValueError("the lm-eval adapter needs a model with a tokenizer")
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.max_length = max_length or llm.plan.max_model_len
        self.requests_per_call = requests_per_call
        self.use_tqdm = use_tqdm
        # What encode() adds around any text (e.g. BOS): stripped where lm-eval wants bare tokens.
        self._special_prefix = list(self.tokenizer.encode(""))
        eos = tuple(getattr(self.tokenizer, "eos_token_ids", ()) or ())
        if self._special_prefix:
            self.prefix_token_id = self._special_prefix[0]
        elif eos:
            self.prefix_token_id = eos[0]
        else:
            raise ValueError("the tokenizer has neither a BOS nor an EOS token to condition the first token on")

    @classmethod
    def from_pretrained(cls, pretrained: str, *, max_length: int | None = None,
                        requests_per_call: int | None = None, use_tqdm: bool = False,
                        **llm_kwargs: Any) -> HybridKVEvaluator:
        return cls(LLM(pretrained, **llm_kwargs), max_length=max_length, requests_per_call=requests_per_call,
                   use_tqdm=use_tqdm)

    # -- tokens --------------------------------------------------------------------------------------------
    def encode_plain(self, text: str) -> list[int]:
        """``text`` without the special tokens ``encode`` adds in front (BOS)."""
        ids = list(self.tokenizer.encode(text))
        n = len(self._special_prefix)
        return ids[n:] if n and ids[:n] == self._special_prefix else ids

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """As lm-eval's HF model: trailing spaces of the context move to the continuation, and the
        continuation's tokens are those of ``encode(context + continuation)`` past ``encode(context)``."""
        if not context:
            return [self.prefix_token_id], self.encode_plain(continuation)
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = list(self.tokenizer.encode(context + continuation))
        ctx = list(self.tokenizer.encode(context))
        return ctx, whole[len(ctx):]

    # -- engine calls ----------------------------------------------------------------------------------------
    def _generate(self, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams]) -> list:
        step = self.requests_per_call or max(1, len(prompts))
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        outputs = []
        for i in range(0, len(prompts), step):
            outputs += self.llm.generate(list(prompts[i:i + step]), plist[i:i + step], use_tqdm=self.use_tqdm)
        for out in outputs:
            if out.error is not None:     # a wrong score would be silent; a failed run is not
                raise RuntimeError(f"hybridkv rejected an lm-eval request: {out.error}")
        return outputs

    def score_sequences(self, sequences: Sequence[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """(tokens, n) -> (sum of log p of the last n tokens given what precedes them, whether each of them
        is the greedy choice). Identical sequences are computed once."""
        unique: dict[tuple[int, ...], int] = {}
        for tokens, n in sequences:
            if not 1 <= n < len(tokens):
                raise ValueError(f"cannot score {n} of {len(tokens)} tokens (need at least one token before them)")
            unique.setdefault(tuple(tokens), len(unique))
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
        outputs = self._generate([list(t) for t in unique], params)
        results = []
        for tokens, n in sequences:
            logprobs = outputs[unique[tuple(tokens)]].prompt_logprobs
            total, greedy = 0.0, True
            for lp in logprobs[len(tokens) - n:]:
                total += lp.logprob
                if lp.top and lp.top[0][0] != lp.token_id and lp.logprob < lp.top[0][1]:
                    greedy = False
            results.append((total, greedy))
        return results

    # -- the three request types ---------------------------------------------------------------------------
    def loglikelihood_tokens(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]
                             ) -> list[tuple[float, bool]]:
        """Token-level ``loglikelihood``; a pair longer than ``max_length`` keeps its last ``max_length``
        tokens (the context is cut first, as lm-eval's HF model does)."""
        sequences = []
        for context, continuation in pairs:
            if not continuation:
                raise ValueError("empty continuation")
            tokens = (list(context) + list(continuation))[-self.max_length:]
            sequences.append((tokens, min(len(continuation), len(tokens) - 1)))
        return self.score_sequences(sequences)

    def loglikelihood(self, requests: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
        return self.loglikelihood_tokens([self.encode_pair(c, x) for c, x in requests])

    def loglikelihood_rolling(self, texts: Sequence[str]) -> list[float]:
        """Log-likelihood of each whole text, in rolling windows of at most ``max_length`` tokens."""
        owners, sequences = [], []
        for i, text in enumerate(texts):
            for context, targets in rolling_windows(self.encode_plain(text), self.prefix_token_id,
                                                    self.max_length - 1):
                owners.append(i)
                sequences.append((context + targets, len(targets)))
        totals = [0.0] * len(texts)
        for owner, (logprob, _) in zip(owners, self.score_sequences(sequences), strict=True):
            totals[owner] += logprob
        return totals

    def sampling_params(self, gen_kwargs: Mapping[str, Any]) -> SamplingParams:
        """lm-eval generation kwargs -> SamplingParams (greedy unless ``do_sample``)."""
        kwargs = dict(gen_kwargs)
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_tokens = int(kwargs.pop("max_gen_toks", kwargs.pop("max_tokens", DEFAULT_MAX_GEN_TOKS)))
        do_sample = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
        params = dict(max_tokens=max_tokens, stop=tuple(s for s in until if s),
                      temperature=temperature if do_sample or temperature > 0 else 0.0)
        for key in ("top_p", "top_k", "min_p", "seed"):
            if kwargs.get(key) is not None:
                params[key] = kwargs.pop(key)
        ignored = sorted(k for k in kwargs if kwargs[k] is not None)
        if ignored:
            logger.warning("hybridkv ignores lm-eval generation kwargs %s", ignored)
        return SamplingParams(**params)

    def generate_until(self, requests: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
        """Continue each context until a stop string, EOS or ``max_gen_toks``; the stop string is not in
        the returned text. Contexts keep their last ``max_length - max_gen_toks`` tokens."""
        prompts, params = [], []
        for context, gen_kwargs in requests:
            p = self.sampling_params(gen_kwargs or {})
            keep = max(1, self.max_length - p.max_tokens)
            prompts.append(list(self.tokenizer.encode(context))[-keep:])
            params.append(p)
        return [out.outputs[0].text or "" for out in self._generate(prompts, params)]


# -- lm-eval glue (imports lm_eval only when asked for) ----------------------------------------------------
def _parse_optional_int(value: Any) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto", "none")):
        return None
    return int(value)


def _resolve_device(device: str | None) -> str:
    """lm-eval's configuration defaults to "cuda:0"; like its HF model, run on the CPU (with a warning)
    when no GPU is present instead of failing."""
    if device in (None, "", "auto"):
        return "auto"
    import torch

    if str(device).startswith("cuda") and not torch.cuda.is_available():
        logger.warning("lm-eval asked for device %s but CUDA is not available; using the CPU", device)
        return "cpu"
    return str(device)


def _build_lm_class() -> type:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model

    class HybridKVLM(LM):
        """lm-eval model ``hybridkv``: ``pretrained`` is a hybridkv or HF checkpoint directory; the other
        model_args go to ``LLM`` (dtype, device, max_model_len, kv_cache_memory, max_num_seqs, block_size,
        enable_prefix_caching, seed) or set ``max_length`` / ``requests_per_call``. lm-eval's ``batch_size``
        is accepted and ignored: the engine batches continuously (up to ``max_num_seqs``) whatever it is."""

        def __init__(self, pretrained: str, *, dtype: str = "auto", device: str | None = None,
                     batch_size: int | str | None = None, max_batch_size: int | str | None = None,
                     max_length: int | str | None = None, max_model_len: int | str | None = None,
                     requests_per_call: int | str | None = None,
                     kv_cache_memory: str | None = None, max_num_seqs: int | str = 256,
                     block_size: int | str = 16, enable_prefix_caching: bool | str = True, seed: int | str = 0,
                     **unused: Any) -> None:
            super().__init__()
            if unused:
                logger.warning("hybridkv ignores model_args %s", sorted(unused))
            caching = enable_prefix_caching if isinstance(enable_prefix_caching, bool) \
                else str(enable_prefix_caching).lower() not in ("0", "false", "no")
            device = _resolve_device(device)
            llm = LLM(pretrained, dtype=dtype, device=device, max_model_len=_parse_optional_int(max_model_len),
                      kv_cache_memory=kv_cache_memory, max_num_seqs=int(max_num_seqs), block_size=int(block_size),
                      enable_prefix_caching=caching, seed=int(seed))
            self.evaluator = HybridKVEvaluator(llm, max_length=_parse_optional_int(max_length),
                                               requests_per_call=_parse_optional_int(requests_per_call))

        @property
        def max_length(self) -> int:
            return self.evaluator.max_length

        @property
        def tokenizer_name(self) -> str:
            return str(getattr(self.evaluator.tokenizer, "source", MODEL_NAME)).replace("/", "__")

        def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
                                ) -> str:
            template = getattr(self.evaluator.tokenizer, "apply_chat_template", None)
            if template is None:
                raise NotImplementedError("this model's tokenizer has no chat template")
            return template(chat_history, add_generation_prompt=add_generation_prompt)

        def _done(self, kind: str, requests: list, results: list) -> list:
            for request, result in zip(requests, results, strict=True):
                self.cache_hook.add_partial(kind, request.args, result)
            return results

        def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            self.evaluator.use_tqdm = not disable_tqdm
            results = self.evaluator.loglikelihood([tuple(r.args[:2]) for r in requests])
            return self._done("loglikelihood", requests, results)

        def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
            self.evaluator.use_tqdm = not disable_tqdm
            results = self.evaluator.loglikelihood_rolling([r.args[0] for r in requests])
            return self._done("loglikelihood_rolling", requests, results)

        def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
            self.evaluator.use_tqdm = not disable_tqdm
            results = self.evaluator.generate_until([(r.args[0], r.args[1]) for r in requests])
            return self._done("generate_until", requests, results)

    HybridKVLM.__module__ = __name__
    HybridKVLM.__qualname__ = "HybridKVLM"
    register_model(MODEL_NAME)(HybridKVLM)
    return HybridKVLM


def register() -> type:
    """Register ``hybridkv`` with lm-eval's model registry (idempotent); returns the LM class."""
    cls = globals().get("HybridKVLM")
    if cls is None:
        cls = _build_lm_class()
        globals()["HybridKVLM"] = cls
    return cls


def __getattr__(name: str) -> Any:
    if name == "HybridKVLM":        # the lm_eval.models entry point resolves this
        return register()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    """lm-eval's command line with ``--model hybridkv`` available (for lm-eval without plugin discovery)."""
    register()
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
