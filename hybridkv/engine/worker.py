"""The entry point of a tensor-parallel rank that ``spawn_group`` starts: ``python -m hybridkv.engine.worker
<job file> <rank>``.

A fresh interpreter that imports only hybridkv (never the caller's ``__main__``): it reads the rendezvous from
the job file, maps the payload (``torch.load(mmap=True)``: an in-memory model's weights are shared through
the page cache, not copied per rank), and runs the pickled ``worker(*args)`` as a spawned rank, i.e. inside
``as_spawned_rank``, where ``LLM(...)`` joins rank 0's group and serves steps until rank 0 shuts down.
Anything that fails before that is written to the rank's error file (rank 0 puts it in its error) and printed
with its traceback; the process then exits with code 1 without running destructors, which could block on a
dead peer.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch

from hybridkv.engine.distributed import SpawnedRank, as_spawned_rank, error_file, exit_with_parent


def _fail(job_file: Path, rank: int, err: BaseException) -> None:
    """Record ``err`` for rank 0 (one line), print its traceback, and exit at once."""
    message = " ".join(f"{type(err).__name__}: {err}".split())
    with contextlib.suppress(OSError):        # gone: rank 0 no longer waits for this rank to join
        error_file(job_file, rank).write_text(message[:2000])
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the job of ``argv`` = (job file, rank); returns only if the job returns (a rank that served until
    shutdown exits from inside it)."""
    job_file, rank = argv if argv is not None else sys.argv[1:]
    job_file, rank = Path(job_file), int(rank)
    try:
        job = json.loads(job_file.read_text())
        exit_with_parent()
        torch.set_num_threads(int(job["threads"]))
        worker, args = torch.load(job_file.with_name(job["payload"]), mmap=True, weights_only=False)
        spawned = SpawnedRank(rank=rank, size=int(job["size"]), host=job["host"], port=int(job["port"]))
    except BaseException as err:
        _fail(job_file, rank, err)
    try:
        with as_spawned_rank(spawned):
            worker(*args)
    except SystemExit:
        raise
    except BaseException as err:
        _fail(job_file, rank, err)


if __name__ == "__main__":
    main()
