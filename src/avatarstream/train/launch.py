"""`avatarstream train RECIPE --nproc N`: the same command under `torchrun --standalone` (N
processes on this machine); what every rank then does is train/distributed.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from avatarstream.errors import AvatarStreamError, ConfigError


def without_nproc(argv: list[str]) -> list[str]:
    """`argv` without its `--nproc N` / `--nproc=N` (what every rank of the launched job gets)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def launch(nproc: int, recipe: str, rest: list[str]) -> dict[str, Any]:
    """`avatarstream train RECIPE --nproc N`: run the same command under `torchrun --standalone`
    (N processes on this machine); rank 0's summary. The ranks' messages go to stderr as they
    come; a failed rank -> one error here."""
    if nproc < 1:
        raise ConfigError("--nproc must be at least 1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--local-ranks-filter=0", "-m", "avatarstream.cli", "train", recipe, *rest, "--json"]
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
    if proc.returncode != 0:
        raise AvatarStreamError(f"training under torchrun ({nproc} processes) failed with exit code "
                                f"{proc.returncode} (the ranks' messages are above)")
    return json.loads(proc.stdout.strip().splitlines()[-1])
