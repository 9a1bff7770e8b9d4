"""What a kernel kind costs a decode step: ``gpu_decode.py`` with that kind's launches skipped.

    python benchmarks/gpu_ablation.py --skip attention -- --families gemma3 --batches 1,32 --backends triton \\
        --no-hf --prefill 0 --check-len 64 --tag ablation_gemma3_attention

``--skip`` (comma-separated): ``norm`` (every add + RMS norm launch), ``reduce`` (the split-KV reduction),
``attention`` (paged attention and its reduction). The skipped kernels' outputs are left unwritten, so the
model computes garbage and only the step times mean something: the time saved is an upper bound on what fusing
that kind away (or making it free) can gain. Everything after ``--`` goes to ``gpu_decode.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu_decode  # noqa: E402

SKIPPABLE = ("norm", "reduce", "attention")


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid: object) -> _NoLaunch:
        return self

    def __call__(self, *args: object, **kwargs: object) -> None:
        return None


def _add_rms_norm_unwritten(delta: torch.Tensor, residual: torch.Tensor, *, weight: torch.Tensor | None,
                            **_: object) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``add_rms_norm``'s outputs, allocated and never written."""
    res_out = torch.empty_like(residual)
    return (torch.empty_like(residual, dtype=weight.dtype) if weight is not None else None), res_out


def skip(kinds: set[str]) -> None:
    """Replace the kernels of ``kinds`` before the backend is built (it reads these module attributes)."""
    from hybridkv.backends import triton_attention, triton_fused

    if "norm" in kinds:
        triton_fused.add_rms_norm_triton = _add_rms_norm_unwritten
    if "reduce" in kinds or "attention" in kinds:
        triton_attention._reduce_segments_kernel = _NoLaunch()
    if "attention" in kinds:
        triton_attention._paged_attention_kernel = _NoLaunch()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip", default="", help=f"comma-separated, of {', '.join(SKIPPABLE)} (empty: none)")
    ap.add_argument("decode_args", nargs=argparse.REMAINDER, help="arguments for gpu_decode.py, after --")
    args = ap.parse_args()
    kinds = {k for k in args.skip.split(",") if k}
    if unknown := kinds - set(SKIPPABLE):
        ap.error(f"--skip: unknown {sorted(unknown)}; known: {', '.join(SKIPPABLE)}")
    skip(kinds)
    rest = args.decode_args[1:] if args.decode_args[:1] == ["--"] else args.decode_args
    sys.argv = [str(Path(gpu_decode.__file__)), *rest]
    gpu_decode.main()


if __name__ == "__main__":
    main()
