"""Engine: requests, scheduler, model runner, sampler and the LLM facade."""

from hybridkv.engine.engine import LLMEngine, RequestError
from hybridkv.engine.llm import LLM
from hybridkv.engine.request import CompletionOutput, RequestOutput, TokenLogprob
from hybridkv.engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "LLMEngine", "RequestError", "RequestOutput", "SamplingParams",
           "TokenLogprob"]
