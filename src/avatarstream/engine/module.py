"""Module: one model and its weights — placement, dtype, offload/onload, timed calls.

A Module holds no control flow of the request. Stages call model methods through `Module.call`,
which runs under inference mode and (optionally) bf16 autocast, and accounts the time spent inside
model code so the engine can report how much of the wall time is *not* model compute.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


# The DiT methods a chunk loop calls every denoising step (our prefix/interp DiT and FlashHead:
# forward; our causal student: forward_causal_block; LiveAvatar: forward_block): what
# `--compile` compiles.
DIT_STEP_METHODS = ("forward", "forward_causal_block", "forward_block")
COMPILE_MODES = {"default": None, "reduce-overhead": "reduce-overhead", "max-autotune": "max-autotune"}


class Module:
    def __init__(
        self,
        name: str,
        model: nn.Module,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        self.name = name
        self.device = torch.device(device)
        self.dtype = dtype
        self.autocast_dtype = autocast_dtype
        self.model = model.to(dtype=dtype).eval()
        self.model.requires_grad_(False)
        self.on_device = False
        self.forward_seconds = 0.0
        self.calls = 0
        self.compiled: dict[str, Callable[..., Any]] = {}  # method -> its torch.compile'd version
        self.onload()

    # -- weights ---------------------------------------------------------------------------------
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    # -- placement -------------------------------------------------------------------------------
    def offload(self) -> None:
        """Move weights to host memory (pinned when a GPU will copy them back)."""
        if not self.on_device:
            return
        self.model.to("cpu")
        if torch.cuda.is_available():
            for p in self.model.parameters():
                p.data = p.data.pin_memory()
        self.on_device = False

    def onload(self) -> None:
        """Move weights to the compute device (no-op on a CPU-only machine)."""
        if self.on_device:
            return
        self.model.to(self.device, non_blocking=True)
        self.on_device = True

    # -- calls -----------------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run `model.<method>(*args, **kwargs)` on the device, timed, without autograd."""
        fn = self.compiled.get(method) or (self.model if method == "forward" else getattr(self.model, method))
        return self.run(fn, *args, **kwargs)

    def compile(self, methods: Sequence[str], mode: str | None = None) -> list[str]:
        """`torch.compile` (inductor, `dynamic=False`: each chunk shape one graph, compiled on its
        first call) the given methods where the model has them; `mode` is torch.compile's
        ("reduce-overhead": CUDA graphs on a GPU). Returns the methods compiled."""
        done = []
        for m in methods:
            if hasattr(self.model, m):
                self.compiled[m] = torch.compile(getattr(self.model, m), dynamic=False, mode=mode)
                done.append(m)
        return done

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a callable that uses this module's model (e.g. a streaming wrapper), timed."""
        if not self.on_device:
            self.onload()
        t0 = time.perf_counter()
        with torch.inference_mode(), self._autocast():
            out = fn(*args, **kwargs)
        self.forward_seconds += time.perf_counter() - t0
        self.calls += 1
        return out

    def reset_stats(self) -> None:
        self.forward_seconds = 0.0
        self.calls = 0


class NotLoaded:
    """Stands in for a network this rank does not load: costs nothing, and a call says which."""

    def __init__(self, name: str, role: str) -> None:
        self.name, self.role = name, role
        self.forward_seconds, self.calls = 0.0, 0
        self.model = None

    def reset_stats(self) -> None:
        pass

    def num_parameters(self) -> int:
        return 0

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"the {self.role} rank does not load the {self.name} (parallel/roles.py) "
                           f"but something called its {method!r}")

    run = call
