"""hybridkv: a runtime for hybrid LLMs whose KV cache treats each layer kind as what it is."""

__version__ = "0.1.0"
