"""Where a job of `generate --workers N` (or `--sequence-parallel`) starts: on processes spawned
here, or as this process's rank when torchrun started it."""

from __future__ import annotations

from typing import Any

from avatarstream.parallel.run import launched_by_torchrun, run_this_rank, spawn
from avatarstream.parallel.tpp import TPPJob


def run_tpp(job: TPPJob) -> dict[str, Any] | None:
    """Run the job: on `job.processes` processes spawned here, or, inside a process torchrun
    started (`parallel/launch.py`), as this process's rank (of the pipeline, or with
    `sequence_parallel` of `parallel/sp_run.py`). Returns the publishing rank's summary
    (`RunSummary.as_dict()` plus `workers`, `processes`, `split_decode`, `step_shares`), None on
    the other ranks of a torchrun job (see `parallel/run.py`)."""
    if job.sequence_parallel:
        from avatarstream.parallel.sp_run import run_sequence_parallel

        return run_sequence_parallel(job)
    return run_this_rank(job) if launched_by_torchrun() else spawn(job)
