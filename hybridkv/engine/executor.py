"""Tensor-parallel execution: rank 0's executor (the ``ModelRunner`` interface the engine drives) and the
step loop of ranks > 0.

Each step, rank 0 broadcasts the scheduler's host batch (``StepBatch`` numpy arrays, plus the Mamba state
copies the coordinator queued since the last step) over the control group; every rank then builds its
own device tensors and metadata from it and runs ``ModelRunner.execute`` on its shard. The forward's
all-reduces keep the residual stream identical on every rank, and the vocab-parallel head gathers the
logits to rank 0, the only rank that samples. Block tables and slot mappings are the scheduler's, so they
are the same on every rank; only the cache tensors behind them are per-rank shards.

On CUDA rank 0 waits for each step's completion event with ``ParallelContext.wait_for`` (bounded by the
timeout, watching the other ranks), so a rank that dies or stalls *inside* the forward, after it took the
step, is an error within the timeout too (NCCL collectives do not block the host, so nothing else would see
it before the watchdog). Tests inject such failures by spawning the ranks through a wrapper of the worker
entry (``distributed.WORKER_COMMAND``), never through anything production code reads.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NoReturn

import torch

from hybridkv.engine.distributed import (
    OP_EXECUTE,
    ParallelContext,
    TensorParallelError,
    header_length,
    pack_step,
    unpack_step,
)
from hybridkv.engine.model_runner import ModelRunner, StepBatch, StepOutput

logger = logging.getLogger("hybridkv.executor")


class TensorParallelExecutor:
    """Rank 0's model runner for a tensor-parallel group: same ``execute`` / ``copy_states`` as
    ``ModelRunner``. Any failure (a rank died, a collective timed out) closes the group and raises
    ``TensorParallelError``; the executor is unusable afterwards (no half-done step is ever retried)."""

    def __init__(self, runner: ModelRunner, ctx: ParallelContext) -> None:
        if not ctx.is_driver:
            raise ValueError("TensorParallelExecutor runs on rank 0; other ranks call serve()")
        self.runner = runner
        self.ctx = ctx
        self.plan = runner.plan
        self._header_len = header_length(len(runner.plan.groups))
        self._copies: list[tuple[int, int]] = []
        self._error: BaseException | None = None

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    def copy_states(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy Mamba states on rank 0 now; the other ranks get the pairs with the next step (they only
        read states inside a step, so the order is the same)."""
        self._check_usable()
        self.runner.copy_states(copies)
        self._copies.extend(copies)

    def host_moves_available(self) -> int:
        """Rank 0's (the ranks move their shards of the same checkpoints at the same rate)."""
        return self.runner.host_moves_available()

    def execute(self, batch: StepBatch) -> StepOutput:
        """Run one step on every rank; returns rank 0's fp32 logits (num_outputs, vocab_size) (and their
        argmax for a greedy batch)."""
        self._check_usable()
        if batch.input_sources is not None:
            raise ValueError("tensor-parallel steps take host input ids only (asynchronous scheduling is off)")
        try:
            self.ctx.check_alive()
            header, payload = pack_step(batch.input_ids, batch.query_lens, batch.seq_lens, batch.block_tables,
                                        batch.logits_indices, self._copies)
            self._copies = []
            self.ctx.send(header, payload)
            out = self.runner.execute(batch)
            if self.ctx.device.type == "cuda":
                done = torch.cuda.Event()
                done.record()
                self.ctx.wait_for(done.query, "the step")
        except Exception as err:
            self._fail(err)
        assert out is not None               # rank 0 receives the gathered logits
        return out

    def shutdown(self) -> None:
        """Stop the other ranks and leave the groups (idempotent)."""
        self.ctx.close(graceful=self._error is None, header_len=self._header_len)

    def _check_usable(self) -> None:
        if self._error is not None:
            raise TensorParallelError(f"the tensor-parallel group failed earlier: {self._error}")
        if self.ctx.closed:
            raise TensorParallelError("the tensor-parallel group is shut down")

    def _fail(self, err: Exception) -> NoReturn:
        self._error = err
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        if not isinstance(err, TensorParallelError):
            # A rank that crashed closes its sockets a moment before it can be reaped: give its exit a
            # moment to show, so the error names the rank rather than only the broken connection.
            self.ctx.await_exits(0.5)
        try:
            self.ctx.check_alive()
        except TensorParallelError as dead:
            detail = str(dead) if str(dead) in detail else f"{dead} ({detail})"
        self.ctx.close(graceful=False)
        raise TensorParallelError(f"tensor-parallel step failed (distributed_timeout={self.ctx.timeout:g}s): "
                                  f"{detail}") from err


def serve(runner: ModelRunner, ctx: ParallelContext) -> None:
    """Ranks > 0: run every step rank 0 sends until it sends shutdown. Errors propagate (the caller exits
    the process, which closes its sockets, so rank 0's next collective fails at once)."""
    header_len = header_length(len(runner.plan.groups))
    while True:
        header, payload = ctx.receive(header_len)
        if int(header[0]) != OP_EXECUTE:
            break
        step = unpack_step(header, payload)
        runner.copy_states(step.pop("copies"))
        runner.execute(StepBatch(**step))
    ctx.close(graceful=True)
