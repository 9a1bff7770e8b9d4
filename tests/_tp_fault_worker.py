"""A spawned tensor-parallel rank that fails inside a step (tests, and benchmarks/tp_decode.py's robustness cases).

It replaces ``python -m hybridkv.engine.worker`` when ``hybridkv.engine.distributed.WORKER_COMMAND`` is
``fault_command(rank, step, action)``: rank ``rank`` exits (code ``EXIT_CODE``) or stops for good in its
``step``-th forward (1-based), just before the middle decoder layer, i.e. after it took the step and the earlier
layers' collectives ran; every other rank runs the plain worker. Production code reads no fault switch.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

EXIT_CODE = 13
ACTIONS = ("exit", "hang")


def fault_command(rank: int, step: int, action: str) -> tuple[str, ...]:
    """The ``WORKER_COMMAND`` that spawns ranks through this script with that fault."""
    if action not in ACTIONS:
        raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
    return (str(Path(__file__).resolve()), f"{rank}:{step}:{action}")


def install_fault(step: int, action: str) -> None:
    """Make this process fail as the module docstring says, in its ``step``-th model forward."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    from hybridkv.models.hybrid import HybridModel

    forwards = [0]

    def fail(module: object, args: object) -> None:
        print(f"fault injected: {action} inside step {step}", file=sys.stderr, flush=True)
        if action == "exit":
            os._exit(EXIT_CODE)
        while True:
            time.sleep(60)

    def count(module: object, args: object) -> None:
        if isinstance(module, HybridModel):
            forwards[0] += 1
            if forwards[0] == step:
                layers = module.layers
                layers[len(layers) // 2].register_forward_pre_hook(fail)

    register_module_forward_pre_hook(count)


if __name__ == "__main__":
    spec, job_file, rank = sys.argv[1:]
    target, step, action = spec.split(":")
    if int(rank) == int(target):
        install_fault(int(step), action)
    from hybridkv.engine.worker import main

    main([job_file, rank])
