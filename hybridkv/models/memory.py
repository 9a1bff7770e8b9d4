"""What a model would allocate, checked against its device before anything is allocated.

Parameter bytes in the target dtype are compared with what the device can give (free GPU memory; available
host memory, within a cgroup limit when there is one): first a lower bound computed from the config alone
(``parameter_lower_bound``: the big matrices), then the exact count of the model built on the meta device. A
config that would not fit (``hidden_size=10**9``) is one clear error instead of an allocation that fails
half-way, takes the host down, or swaps for minutes.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hybridkv.models.config import DenseMoE, HybridConfig, MixerConfig, MoE
from hybridkv.utils import format_bytes


def check_device(device: torch.device) -> None:
    """Raise ``ValueError`` if ``device`` cannot be used on this machine (CUDA asked for, none visible)."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = ("this torch build has no CUDA support" if torch.version.cuda is None
               else "no CUDA device is visible (driver missing, or CUDA_VISIBLE_DEVICES is empty)")
        raise ValueError(f"device {str(device)!r} is not available: {why}; use device='cpu'")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r} is not available: this host has {torch.cuda.device_count()} "
                         f"CUDA device(s)")


def _cgroup_headroom() -> int | None:
    """Bytes this process's cgroup may still allocate (v2, then v1), or None without a limit."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:           # v1 writes a huge number for "no limit"
            return max(0, int(limit) - usage)
    return None


def host_available_bytes() -> int | None:
    """Host memory this process can still use: MemAvailable (free + reclaimable cache), bounded by the cgroup
    limit; None where it cannot be read."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None
    headroom = _cgroup_headroom()
    return available if headroom is None else min(available, headroom)


def available_bytes(device: torch.device) -> int | None:
    """Memory ``device`` can still give: free memory on a GPU, ``host_available_bytes`` on the CPU; None when
    unknown (other device types)."""
    check_device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        return host_available_bytes()
    return None


def _mixer_matrices(mixer: MixerConfig | None, hidden: int, width: int) -> int:
    """Elements of a mixer's projection matrices (``width``: its input width; its kind's ``matrix_elements``)."""
    return 0 if mixer is None else mixer.matrix_elements(hidden, width)


def _ffn_matrices(ffn: object, hidden: int) -> int:
    if ffn is None:
        return 0
    if isinstance(ffn, DenseMoE):
        return _ffn_matrices(ffn.mlp, hidden) + _ffn_matrices(ffn.moe, hidden)
    if isinstance(ffn, MoE):
        width = ffn.latent_size or hidden
        latent = 2 * hidden * ffn.latent_size if ffn.latent_size else 0
        per_expert = (3 if ffn.gated else 2) * width * ffn.intermediate_size
        shared = (3 if ffn.gated else 2) * hidden * ffn.shared_intermediate_size
        return ffn.num_experts * (per_expert + hidden) + latent + shared
    return (3 if ffn.gated else 2) * hidden * ffn.intermediate_size


def parameter_lower_bound(config: HybridConfig, tensor_parallel_size: int = 1) -> int:
    """Parameter elements one of ``tensor_parallel_size`` ranks holds at least, from the config alone: the
    embedding, head, projection and expert matrices over the ranks (biases, norms and small vectors left out,
    so it never exceeds the model's count). Cheap whatever the config says, so a config too large for any
    device is refused before anything is built."""
    hidden = config.hidden_size
    total = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
    blocks = {}
    for layer in config.layers:
        total += _mixer_matrices(layer.mixer, hidden, hidden) + _mixer_matrices(layer.parallel_mixer, hidden, hidden)
        total += _ffn_matrices(layer.ffn, hidden)
        if layer.shared_block is not None:
            block = layer.shared_block
            width = 2 * hidden if block.concat_embeddings else hidden
            blocks[block.block_id] = (_mixer_matrices(block.attention, hidden, width)
                                      + _ffn_matrices(block.mlp, hidden))
            total += hidden * hidden                      # each use's output linear
    # Per-layer inputs (Gemma-4): their table and projections are replicated on every rank.
    size, layers = config.per_layer_input_size, len(config.layers)
    per_layer = size * layers * ((config.per_layer_vocab_size or config.vocab_size) + 3 * hidden) if size else 0
    # Gemma-3n's AltUp stream projections (2 per extra stream) and Laurel branches, replicated too.
    streams = config.altup.num_inputs - 1 if config.altup is not None else 0
    per_layer += 2 * streams * hidden * hidden + 2 * layers * hidden * config.laurel_rank
    return (total + sum(blocks.values())) // tensor_parallel_size + per_layer


def check_fits(count: int, dtype: torch.dtype, device: torch.device, *, what: str = "the model",
               at_least: bool = False) -> None:
    """Raise ``MemoryError`` (one line) if ``count`` parameter elements in ``dtype`` exceed what ``device`` has
    available (``at_least``: ``count`` is a lower bound)."""
    needed = count * dtype.itemsize
    available = available_bytes(device)
    if available is not None and needed > available:
        where = "free on" if device.type == "cuda" else "available on"
        raise MemoryError(f"{what} needs {'at least ' if at_least else ''}{format_bytes(needed)} for its parameters "
                          f"({str(dtype).removeprefix('torch.')}), more than the {format_bytes(available)} {where} "
                          f"{device}; check the config (hidden_size, layers, vocab_size), or use a smaller dtype, "
                          f"tensor_parallel_size > 1 or another device")
