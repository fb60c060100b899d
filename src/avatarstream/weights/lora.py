"""LoRA adapters as PEFT saves them, checked against a network and merged into it at load time.

Why our own merge (~40 lines) and not `peft`: a merged adapter is W += (alpha / rank)·B@A on
the targeted linear weights, nothing more; PEFT would wrap every module, load with
`strict=False` (which hides an adapter that matches nothing: LiveAvatar's own loader runs on
silently then: docs/real-models.md, "The LoRA") and pull in a dependency for one matrix product.

What a file may hold (PEFT's `save_pretrained` and `get_peft_model_state_dict`, both forms):
`[base_model.model.]<module>.lora_A[.default].weight` `[rank, in]` and the matching `lora_B`
`[out, rank]`. Anything else in the file (a full weight, a bias, a DoRA magnitude) is refused:
loaded over the base weights it would silently change the model.

Which modules are targeted follows PEFT's `target_modules` rule: a module whose name equals a
target or ends with "." + target, among the network's 2-D `.weight` tensors (its linears). The
file must cover exactly those modules, each once: a missing pair, a pair for a module the network
does not target, or a shape that is not `[rank, in]` / `[out, rank]` is one error listing them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from avatarstream.errors import InputError

# `[base_model.model.]<module>.lora_A|B[.default].weight`
LORA_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight")


@dataclass(frozen=True)
class LoRASettings:
    """The adapter's training settings (PEFT's `LoraConfig`): the file itself stores neither the
    scale nor the targets, so a merge needs them from the recipe that trained it."""

    rank: int
    alpha: float
    targets: tuple[str, ...]  # PEFT target_modules: module-name suffixes

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def targeted(self, module: str) -> bool:
        return any(module == t or module.endswith("." + t) for t in self.targets)


# LiveAvatar's adapter (`liveavatar/configs/s2v_causal_sft.yaml`: r 128, alpha 64 -> scale 0.5)
LIVEAVATAR_LORA = LoRASettings(rank=128, alpha=64.0, targets=("q", "k", "v", "o", "ffn.0", "ffn.2"))


def target_modules(shapes: Mapping[str, Sequence[int]], settings: LoRASettings) -> dict[str, tuple[int, int]]:
    """The modules an adapter must cover: `{module: (out, in)}` for every 2-D `<module>.weight`
    of a network's state dict (`shapes`: key -> shape) that `settings` targets."""
    out = {}
    for key, shape in shapes.items():
        module, _, leaf = key.rpartition(".")
        if leaf == "weight" and len(shape) == 2 and settings.targeted(module):
            out[module] = (int(shape[0]), int(shape[1]))
    return out


@dataclass
class LoRAMatch:
    """How a LoRA file fits a network: `pairs` module -> (A key, B key); `problems` empty = mergeable."""

    pairs: dict[str, tuple[str, str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def _some(items: Sequence[str], n: int = 4) -> str:
    return ", ".join(repr(k) for k in items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def match_lora(stored: Mapping[str, Sequence[int]], targets: Mapping[str, tuple[int, int]],
               settings: LoRASettings, what: str) -> LoRAMatch:
    """Check a LoRA file's tensors (`stored`: key -> shape, from a header or the tensors) against
    the network's `targets` (`target_modules`). Every problem is listed, naming `what` and keys."""
    out = LoRAMatch()
    halves: dict[str, dict[str, str]] = {}
    stray = []
    for key in stored:
        m = LORA_KEY.fullmatch(key)
        if m is None:
            stray.append(key)
            continue
        got = halves.setdefault(m["module"], {})
        if m["ab"] in got:
            out.problems.append(f"{what}: {got[m['ab']]!r} and {key!r} are the same LoRA tensor (both key forms)")
        got[m["ab"]] = key
    if stray:
        out.problems.append(f"{what}: {len(stray)} tensor(s) that are not LoRA A/B weights: {_some(stray)}; "
                            "refused, since loading them would overwrite the base model")
    half = sorted(m for m, ab in halves.items() if len(ab) < 2)
    if half:
        out.problems.append(f"{what}: {len(half)} module(s) with only one of lora_A/lora_B: {_some(half)}")
    unmatched = sorted(m for m in halves if m not in targets)
    missing = sorted(m for m in targets if m not in halves)
    if unmatched:
        out.problems.append(f"{what}: {len(unmatched)} LoRA module(s) the network has no target for: "
                            f"{_some(unmatched)}")
    if missing:
        out.problems.append(f"{what}: {len(missing)} of the {len(targets)} targeted modules have no LoRA "
                            f"pair: {_some(missing)} (expected exactly {len(targets)} pairs)")
    r = settings.rank
    shapes = []  # one line for all of them: a LoRA of another model mismatches every pair
    for module in sorted(set(halves) & set(targets)):
        if len(halves[module]) < 2:
            continue
        (o, i), ka, kb = targets[module], halves[module]["A"], halves[module]["B"]
        for key, want in ((ka, (r, i)), (kb, (o, r))):
            if tuple(stored[key]) != want:
                shapes.append(f"{key!r} is {list(stored[key])}, expected {list(want)} ({module} is [{o}, {i}])")
        out.pairs[module] = (ka, kb)
    if shapes:
        more = f" and {len(shapes) - 2} more" if len(shapes) > 2 else ""
        out.problems.append(f"{what}: {len(shapes)} LoRA tensor(s) of another shape than rank {r} on this network "
                            f"needs: {'; '.join(shapes[:2])}{more}")
    return out


def summary(problems: Sequence[str], n: int = 2) -> str:
    """The first `n` problems and how many more: one line, however many there are."""
    return "; ".join(problems[:n]) + (f" (and {len(problems) - n} more problem(s))" if len(problems) > n else "")


@torch.no_grad()
def merge_lora(net: nn.Module, lora: Mapping[str, torch.Tensor], settings: LoRASettings, *,
               what: str = "LoRA", device: str | torch.device | None = None) -> int:
    """Merge an adapter into `net` in place: W += scale·B@A for every targeted weight, computed in
    fp32 and cast back to W's dtype, one module at a time (one fp32 copy of one weight at a time:
    bounded memory on a 14 B model). InputError, before any weight changes, when the file does
    not match exactly (`match_lora`). device: where the products run (default: each weight's own;
    a GPU for weights kept on the CPU). Returns the number of merged pairs."""
    params = dict(net.named_parameters())
    targets = target_modules({k: tuple(p.shape) for k, p in params.items()}, settings)
    match = match_lora({k: tuple(t.shape) for k, t in lora.items()}, targets, settings, what)
    if match.problems:
        raise InputError(summary(match.problems))
    for k in (k for pair in match.pairs.values() for k in pair):
        t = lora[k]
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise InputError(f"{what}: {k!r} is not a finite floating-point tensor ({t.dtype}); a broken adapter")
    for module, (ka, kb) in match.pairs.items():
        w = params[f"{module}.weight"]  # [out, in]
        dev = w.device if device is None else torch.device(device)
        merged = w.to(device=dev, dtype=torch.float32)  # w itself when fp32 and there: merged in place
        a = lora[ka].to(device=dev, dtype=torch.float32)  # [r, in]
        b = lora[kb].to(device=dev, dtype=torch.float32)  # [out, r]
        merged.addmm_(b, a, alpha=settings.scale)
        if merged is not w:
            w.copy_(merged)
        del merged, a, b
    return len(match.pairs)
