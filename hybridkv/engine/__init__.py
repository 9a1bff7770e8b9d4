"""Engine: requests, scheduler, model runner, sampler, the thread-safe front, and the LLM / AsyncLLM facades."""

from hybridkv.engine.async_llm import AsyncLLM
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import LLMEngine, RequestError
from hybridkv.engine.llm import LLM
from hybridkv.engine.request import CompletionOutput, RequestOutput, TokenLogprob
from hybridkv.engine.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestError", "RequestOutput",
           "SamplingParams", "TokenLogprob"]
