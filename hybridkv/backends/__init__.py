"""Kernel backends (torch reference | triton | vendor) and per-group metadata builders."""

from hybridkv.backends.registry import KernelBackend, available_backends, get_backend

__all__ = ["KernelBackend", "available_backends", "get_backend"]
