"""torchrun's entry point: `torchrun --nproc-per-node N -m avatarstream.parallel.launch generate ...`.

Every process torchrun starts runs `avatarstream generate` with the arguments given; generate
sees torchrun's environment and runs this process's rank of the timestep-forcing pipeline
(`parallel/run.py`: `env://`, so `--nnodes`/`--rdzv-endpoint` spread the ranks over machines;
NCCL with `--device cuda`, gloo on CPUs). Without `--workers` the plan is the one the world size
allows (N - 1 denoise workers + 1 decode, N - 2 with `--split-decode`); with it, a world size
that does not match is refused by every rank with one line. With `--sequence-parallel` the N
ranks shard each DiT block instead (`parallel/sp_run.py`).

The CLI is run as a program (`runpy`), not imported: the command line sits above every package,
and `parallel` is one of the packages it drives.
"""

from __future__ import annotations

import os
import runpy
import sys

from avatarstream.parallel.run import launched_by_torchrun


def plan_arguments(argv: list[str], world: int) -> list[str]:
    """`argv` with `--workers` filled in from the world size when it is not given."""
    if "--sequence-parallel" in argv or any(a == "--workers" or a.startswith("--workers=") for a in argv):
        return argv
    return [*argv, "--workers", str(max(1, world - 1 - ("--split-decode" in argv)))]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["generate"]:
        print("usage: torchrun --nproc-per-node N -m avatarstream.parallel.launch generate "
              "--strategy causal [generate options]", file=sys.stderr)
        return 2
    if not launched_by_torchrun():
        print("avatarstream.parallel.launch: error: start me with torchrun (or run `avatarstream "
              "generate --workers N`, which starts its own processes)", file=sys.stderr)
        return 2
    sys.argv = ["avatarstream", *plan_arguments(argv, int(os.environ["WORLD_SIZE"]))]
    try:
        runpy.run_module("avatarstream.cli", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
