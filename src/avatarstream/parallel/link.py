"""The point-to-point transport between the ranks of a timestep-forcing pipeline
(`parallel/tpp.py`, `parallel/liveavatar_tpp.py`): latents sent and received as flat float32
tensors, every transfer waited for with a deadline, and the one-line failure of a rank whose peer
stopped (`RankFailure`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from avatarstream.errors import AvatarStreamError

TAG_LATENT, TAG_SINK = 1, 2


class RankFailure(AvatarStreamError):
    """This rank stops because another one did (or the launcher stopped it): one line, exit 1."""

    exit_code = 1


def wait_for(start: Callable[[], Any], rank: int, what: str, timeout_s: float) -> None:
    """Start an async transfer (`start()`: a `dist.isend`/`irecv`) and wait for it at most
    `timeout_s`. A transport error (gloo: the peer's connection closed, reported at once, when
    the transfer starts or while it is waited for) or the deadline (NCCL, or a peer that hangs)
    -> RankFailure naming `what`. gloo's point-to-point work completes only inside `wait` and
    cannot be waited for again after a timeout, so it is one timed wait, made (gloo) on a thread
    of its own: the main thread waits for that thread in short steps, so a SIGTERM from the
    launcher is handled at once (its RankFailure raised here) even while the transfer is stuck in
    C++. (NCCL's wait orders the calling thread's CUDA streams: it stays on this thread.)"""
    outcome: list[BaseException] = []
    done = threading.Event()

    def wait(work: Any) -> None:
        try:
            work.wait(timeout=timedelta(seconds=timeout_s))
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            outcome.append(e)
        finally:
            done.set()

    try:
        work = start()
        if dist.get_backend() != "gloo":  # NCCL: its wait orders CUDA streams of this thread
            work.wait(timeout=timedelta(seconds=timeout_s))
            return
        threading.Thread(target=wait, args=(work,), name=f"avatarstream-wait-{what}", daemon=True).start()
        while not done.wait(0.2):  # signal handlers run between the steps
            pass
        if outcome:
            raise outcome[0]
    except RuntimeError as e:
        msg = str(e)
        if "timed out" in msg.lower() or "timeout" in msg.lower():
            raise RankFailure(f"rank {rank}: no {what} for {timeout_s:.0f} s (did that rank stop?); "
                              "stopping") from None
        first = next((ln for ln in msg.splitlines() if ln.strip()), type(e).__name__)
        first = first.split("] ", 1)[-1].split(". This is")[0][:160]  # gloo: its source location first
        raise RankFailure(f"rank {rank}: lost {what} ({first}); stopping") from None


class Link:
    """Point-to-point latent transport of one rank (tensors staged on the rank's device), every
    transfer waited for with a deadline (`wait_for`)."""

    def __init__(self, rank: int, device: torch.device, timeout_s: float = 600.0) -> None:
        self.rank, self.device, self.timeout_s = rank, device, timeout_s

    def send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        buf = t.detach().float().contiguous().to(self.device)
        wait_for(lambda: dist.isend(buf, dst, tag=tag), self.rank, f"the link to rank {dst} (send)",
                 self.timeout_s)

    def recv(self, shape: tuple[int, ...], src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=torch.float32, device=self.device)
        wait_for(lambda: dist.irecv(buf, src, tag=tag), self.rank, f"latents from rank {src}", self.timeout_s)
        return buf.cpu()
