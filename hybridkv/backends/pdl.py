"""Programmatic dependent launch (PDL, Hopper and later) for the Triton kernels.

A decode step is a chain of a few hundred small kernels; between two of them the GPU normally drains the first
grid, then launches and ramps up the second. Launched with PDL, the next kernel's programs are scheduled while
the previous kernel's last programs still run, and wait (``griddepcontrol.wait``) until it has finished and its
writes are visible. On an H100 inside a CUDA graph, a chain of one-program norm kernels took 1.60 -> 1.30 µs
per kernel, norm + decode-size linear 7.15 -> 5.84 µs per pair; an edge into a kernel that is not ours
(cuBLAS) gains nothing.

The rule that keeps this correct: every kernel here starts with ``pdl_wait(PDL)``, before its first global
read or write and before any program can exit. So a kernel never sees its predecessor's half-written outputs,
never overwrites what the predecessor still reads, and finishes only after the predecessor has (kernels two
apart stay ordered too). One exception: decode attention reads the step's metadata (``query_start_loc``,
``seq_lens``) before its wait; the host (or a torch op, which never releases its dependents early) writes it,
never the kernel just before, and a kernel only starts once the one two before it has finished.
Kernels that are not ours (cuBLAS, torch) launch normally and wait for everything
before them, as always. Why weights (which no kernel writes) are not read before the wait either: loading the
linear kernel's first weight tile, or prefetching it into the L2, early measured slower on every shape (the
held tile costs registers, the prefetches crowd the L2 and the issue slots).

The Triton interpreter and pre-Hopper GPUs never use it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from hybridkv import envs

__all__ = ["pdl_kwargs", "pdl_wait"]


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the previous kernel (a no-op without PDL), then let the next one be scheduled."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.cache
def _enabled(device: torch.device) -> bool:
    if device.type != "cuda" or envs.triton_interpret():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_kwargs(device: torch.device) -> dict[str, bool]:
    """Launch keywords for a kernel with a ``PDL`` constexpr that calls ``pdl_wait(PDL)`` first."""
    on = _enabled(device)
    return {"PDL": on, "launch_pdl": on}
