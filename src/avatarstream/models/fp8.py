"""Weight-only fp8 for the big DiTs: each selected `nn.Linear` keeps its matrix as
`float8_e4m3fn` (1 byte per weight) with one float32 scale per output row, and computes in the
activations' precision. This is what the fp8 memory plans of `avatarstream models check` count
(weights/plans.py, docs/real-models.md "Memory plans"): the blocks' and audio injectors' matrices
at 1 byte, everything else as loaded.

Order of operations (as LiveAvatar's own `--fp8`: after the LoRA merge): load the checkpoint in bf16 (the LoRA merged in fp32
first), then `quantize_linears_`. fp8 is applied after loading, never loaded: a quantized
layer's state dict holds `weight` (fp8) and `weight_scale` (fp32) and loads back into a
quantized layer exactly, but refuses a bf16/fp32 `weight` (its values would be cast to fp8
without a scale).

Which layers (`LIVEAVATAR_FP8`, `FLASHHEAD_FP8`): LiveAvatar's official `--fp8` replaces every
`nn.Linear` of the DiT except `text_embedding`, `time_embedding`, `time_projection`, `head.head`
and `casual_audio_encoder.encoder.final_linear` (/minimal_inference/s2v_streaming_interact.py,
the `ignore_keys` of /liveavatar/utils/fp8_linear.py's `replace_linear_with_scaled_fp8`). In this
DiT the linears left are exactly those under `blocks` and `audio_injector` (400 + 60 at the 14B
size, 15.9 of 16.3 B parameters), so `LIVEAVATAR_FP8 = ("blocks", "audio_injector")` is the same
choice. FlashHead has no official fp8; its blocks' linears hold 1.39 of its 1.50 B parameters (Pro).

How ours differs from the official fp8: it keeps one scale per weight tensor and also quantises
the activations (one dynamic scale per call) to run `torch._scaled_mm` with fast accumulation.
Ours keeps a scale per output row and does not quantise activations: the only error is the
weight's rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from avatarstream.errors import InputError

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448: e4m3 has 4 exponent bits, 3 mantissa bits, no inf
LIVEAVATAR_FP8 = ("blocks", "audio_injector")  # the official choice (module doc)
FLASHHEAD_FP8 = ("blocks",)
# which extra linears to quantise: (qualified name, layer) -> bool
LinearPredicate = Callable[[str, nn.Module], bool]


def quantize_fp8(weight: torch.Tensor, *, per_row: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """weight `[out, in]` -> (q `[out, in]` float8_e4m3fn, scale fp32 `[out]`, or `[]` when not
    per_row) with weight ≈ q · scale and scale = amax / 448 (the row's, or the tensor's).

    Rounding: e4m3 keeps 3 mantissa bits, so a value whose |w / scale| is at least 2^-6 (a normal
    e4m3 number) comes back within 1/17 = 5.9e-2 of itself (relative: half a step of 2^-3, at
    worst just above a power of two, 2^-4 / (1 + 2^-4)); smaller ones (subnormals) within
    2^-10 · scale (absolute). Gaussian weights come back within 2.6 % (relative Frobenius).
    Raises ValueError on a non-finite weight."""
    w = weight.detach()
    amax = (w.abs().amax(dim=1) if per_row else w.abs().amax()).float()
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("the weight holds inf or NaN")
    scale = amax.clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX  # a zero row stays zero
    s = scale[:, None] if per_row else scale
    return (w.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q · scale in `dtype`, rounded once: fp8 -> dtype is exact (bf16, fp16 and fp32 hold every
    e4m3 value), and the in-place product is computed in fp32 and rounded to dtype."""
    return q.to(dtype).mul_(scale[:, None] if scale.dim() == 1 else scale)


def _keep_dtype(fn: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    """`fn` (what `Module.to`, `.cuda()`, `.half()` apply) on a quantised tensor, its device
    change kept and its dtype change dropped. A probe of no elements tells what fn would do."""
    probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
    return fn(t) if probe.dtype == t.dtype else t.to(probe.device)


def _no_weights(linear: nn.Linear) -> str | None:
    """Why `linear` holds no weights to quantise (built on meta, or offloaded), or None."""
    w = linear.weight
    if w.is_meta:
        return "built on the meta device"
    if w.shape != (linear.out_features, linear.in_features):
        return f"whose weight is {tuple(w.shape)}, not {(linear.out_features, linear.in_features)} (offloaded?)"
    return None


class Float8Linear(nn.Module):
    """`nn.Linear` with its weight in fp8 (weight-only quantisation), for inference.

    Holds `weight` `[out, in]` float8_e4m3fn (a parameter that needs no gradient), `weight_scale`
    `[out]` float32 (a buffer) and `bias` `[out]` as the linear had it (bf16 or fp32).

    Why a scale per output row, not one per tensor: rows (output channels) of a trained layer
    differ in size (outlier channels), and e4m3 keeps its 3 mantissa bits only from 2^-6 to 448
    in scaled units: below 2^-6 · scale it has fewer bits (subnormals), below 2^-10 · scale it
    rounds to zero. With one scale, a row k times smaller than the tensor's largest sits k times
    nearer that floor; with its own, every row's largest weight maps to 448. Measured
    (`test_per_row_scales_beat_one_scale_per_tensor`): on our trained avatarstream-small blocks,
    whose rows differ by 2-3x, the two barely differ (2.60 % against 2.65 % relative error, worst
    row 3.2 % against 3.4 %); on rows spread log-normally (σ = 2) per row keeps every row within
    2.9 % while one scale per tensor flushes the smallest rows to zero (100 %). It costs 4 bytes
    per row (0.08 % of a 5120-wide fp8 row), and a row scale is a scale of the output channel,
    so it commutes with the matmul.

    forward(x `[..., in]`) -> `[..., out]`: the weight dequantised to x's dtype (or to the
    autocast dtype when autocast is on for x's device), then `F.linear`. A transient copy of one
    layer's weight in that dtype exists during the call, never more than one.

    The faster path on CUDA with compute capability >= 8.9 (Ada, Hopper) would skip the
    dequantisation: quantise x to fp8 too (a dynamic amax per call or per token row) and call
    `torch._scaled_mm(x_fp8 [M, in], weight.t() (column-major [in, out]), scale_a, scale_b,
    bias=bias, out_dtype=torch.bfloat16)`, which reads the 1-byte weight directly and runs on the
    fp8 tensor cores (twice bf16's peak). Our row scales are its row-wise `scale_b` of shape
    `[1, out]`, with `scale_a` `[M, 1]`; in the torch releases whose notes we read, row-wise
    scaling ran on a Hopper-only (sm_90) kernel while tensor-wise scales (one each, the official
    choice) work from sm_89. Both need `in` and `out` divisible by 16, and add the activations'
    own e4m3 rounding to the weight's. It is not implemented here: no test here can run it.

    `module.to(dtype)`, `.half()`, `.float()` leave the fp8 weight and fp32 scale as they are
    (only the bias follows), so wrapping a quantised model in a bf16 `engine.Module` keeps it at
    1 byte; device moves move everything.
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.dtype != FP8 or weight.dim() != 2 or scale.shape != weight.shape[:1]:
            raise ValueError(f"Float8Linear takes an fp8 [out, in] weight and an [out] scale, got "
                             f"{weight.dtype} {tuple(weight.shape)} and {tuple(scale.shape)}")
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("weight_scale", scale.float())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, device: torch.device | str | None = None) -> Float8Linear:
        """A quantised copy of `linear` (which must hold its weights: not meta, not offloaded),
        computed on `device` (default: where the weight is) and kept where the weight was."""
        problem = _no_weights(linear)
        if problem:
            raise ValueError(f"cannot quantise a linear {problem}: load the checkpoint, quantise, then offload")
        w = linear.weight
        q, scale = quantize_fp8(w if device is None else w.to(device))
        return cls(q.to(w.device), scale.to(w.device), linear.bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight `[out, in]` in `dtype`."""
        return dequantize_fp8(self.weight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        dt = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        b = None if self.bias is None else self.bias.to(dt)
        return F.linear(x, self.dequantize(dt), b)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Float8Linear:
        """Device moves apply to every tensor, dtype casts to the bias only (class doc)."""
        for name, t in (("bias", None if self.bias is None else fn(self.bias.data)),
                        ("weight", _keep_dtype(fn, self.weight.data))):
            p = self._parameters[name]
            if p is None or t is None:
                continue
            if torch._has_compatible_shallow_copy_type(p, t):  # as Module._apply: keep the Parameter
                p.data = t
            else:  # e.g. to or from the meta device
                self._parameters[name] = nn.Parameter(t, requires_grad=False)
        self.weight_scale = _keep_dtype(fn, self.weight_scale)
        return self

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        w = state_dict.get(prefix + "weight")
        if w is not None and w.dtype != FP8:
            error_msgs = args[-1]
            error_msgs.append(f"{prefix}weight: a {w.dtype} weight cannot load into an fp8 layer (it "
                              "would be cast without its scale); load the checkpoint, then quantise")
            return
        super()._load_from_state_dict(state_dict, prefix, *args)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, weight=float8_e4m3fn, scale=per row"


@dataclass(frozen=True)
class Fp8Stats:
    """What `quantize_linears_` did: layers converted now and found already in fp8, and the
    bytes of the converted layers' tensors (weight + bias before; weight + scale + bias after)."""

    converted: int
    already: int
    parameters: int  # weights of the converted layers
    bytes_before: int
    bytes_after: int


def _nbytes(*ts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _targets(module: nn.Module, names: Sequence[str], predicate: LinearPredicate | None
             ) -> tuple[list[str], int]:
    """Qualified names of the linears to convert (under `names`, or chosen by `predicate`), and
    how many Float8Linear layers the same selection already holds."""
    for n in names:
        try:
            module.get_submodule(n)
        except AttributeError:
            raise ValueError(f"{type(module).__name__} has no submodule {n!r} to quantise") from None
    todo, already = [], 0
    for qual, m in module.named_modules():
        inside = any(qual == n or qual.startswith(n + ".") for n in names)
        if not isinstance(m, (nn.Linear, Float8Linear)):
            continue
        if inside or (predicate is not None and predicate(qual, m)):
            if isinstance(m, Float8Linear):
                already += 1
            else:
                todo.append(qual)
    return todo, already


@torch.no_grad()
def quantize_linears_(module: nn.Module, *, names: Sequence[str] = ("blocks",),
                      predicate: LinearPredicate | None = None,
                      device: torch.device | str | None = None) -> Fp8Stats:
    """Replace, in place, every `nn.Linear` under the submodules `names` (dotted paths: "blocks",
    "audio_injector"), and every other one `predicate(qualified_name, linear)` picks, by a
    `Float8Linear`. Layers already in fp8 are left alone (a second call converts nothing).

    One layer at a time: each quantised copy replaces its linear at once and no reference to the
    old one is kept, so memory never holds a second copy of the model, only one layer's
    transients (its weight in fp32 while it is scaled). Quantisation runs where the weights are,
    or on `device` one layer at a time (a CPU-resident model quantised on its GPU: the 14B's
    15.9 B weights took ~150 s on a 2-core CPU by extrapolation from one 5120 x 13824 layer);
    each result goes back where its weight was.

    Refused before anything changes (ValueError): a model built on the meta device, or offloaded
    (its block parameters empty), or a missing submodule. A non-finite weight stops the
    conversion with an InputError naming the parameter (the checkpoint is broken; drop the model)."""
    todo, already = _targets(module, names, predicate)
    for qual in todo:
        problem = _no_weights(module.get_submodule(qual))  # type: ignore[arg-type]
        if problem:
            raise ValueError(f"{qual}: a linear {problem}; quantise after loading, before offloading")
    converted = params = before = after = 0
    for qual in todo:
        parent, _, child = qual.rpartition(".")
        owner = module.get_submodule(parent)
        lin = getattr(owner, child)
        before += _nbytes(lin.weight, lin.bias)
        params += lin.weight.numel()
        try:
            new = Float8Linear.from_linear(lin, device=device)
        except ValueError as e:
            raise InputError(f"{qual}.weight: {e}; the checkpoint is broken") from None
        del lin
        setattr(owner, child, new)
        after += _nbytes(new.weight, new.weight_scale, new.bias)
        converted += 1
    return Fp8Stats(converted, already, params, before, after)
