"""Evaluations on top of the public API (``LLM``, ``SamplingParams``): ``humaneval`` (pass@k, completions
run in isolated processes by ``sandbox``), ``gsm8k`` (8-shot chain-of-thought exact match) and
``lm_eval_adapter`` (the lm-evaluation-harness model ``hybridkv``). ``hybridkv.eval.cli`` adds the
``hybridkv eval`` command; submodules are imported on use, so importing this package stays cheap."""

__all__ = ["cli", "gsm8k", "humaneval", "lm_eval_adapter", "sandbox"]
