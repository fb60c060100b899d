"""Run under torchrun: sequence-parallel generation of argv[1] (audio) with argv[2] (reference)
by tiny-random, the raw frames written to argv[3] by rank 0 (`parallel/sp_run.py`)."""

from __future__ import annotations

import sys

from avatarstream.parallel.sp_run import run_sequence_parallel
from avatarstream.parallel.tpp import TPPJob

if __name__ == "__main__":
    run_sequence_parallel(TPPJob(model="tiny-random", reference=sys.argv[2], audio=sys.argv[1],
                                 frames_out=sys.argv[3], overrides={"strategy": "causal"}))
