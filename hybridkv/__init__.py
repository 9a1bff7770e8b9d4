"""hybridkv: a runtime for hybrid LLMs whose KV cache treats each layer kind as what it is."""

from hybridkv.engine import LLM, AsyncLLM, EngineConfig, RequestOutput, SamplingParams
from hybridkv.models.config import HybridConfig
from hybridkv.planning import plan

__version__ = "0.1.0"

__all__ = ["LLM", "AsyncLLM", "EngineConfig", "HybridConfig", "RequestOutput", "SamplingParams", "__version__", "plan"]
