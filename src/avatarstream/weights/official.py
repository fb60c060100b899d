"""Loading the files an official release ships, as a user downloads them.

- `read_state(path)`: a `.safetensors` file, a sharded `*.safetensors.index.json` (its shards next
  to it) or a `.pth` (`torch.load(weights_only=True, mmap=True)`: memory-mapped, never unpickled
  code); safetensors are memory-mapped too. A missing, partial or corrupt file is one `InputError`
  naming the file.
- `build_loaded(factory, state)`: the network is built on the meta device (no memory for its
  parameters) and the stored tensors are assigned in place (`load_state_dict(assign=True)`), cast
  to the wanted dtype one tensor at a time, so a checkpoint never exists twice in RAM. Keys the
  network does not have are skipped by name only when the caller lists them (`unused`); any other
  mismatch is an error naming the key and both shapes. Buffers that are not in a checkpoint (RoPE
  tables) are made by the module's `init_buffers_()` once its parameters are real.

Key renames and reshapes of a family live in its `StateDictAdapter` (weights/adapters.py), applied
before `build_loaded`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from avatarstream.errors import InputError
from avatarstream.weights.headers import read_pth, safetensors_header
from avatarstream.weights.validate import confine, read_json, shard_names


def read_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of one checkpoint file (or sharded index), memory-mapped where the format
    allows, after the checks `models check` makes (weights/headers.py, weights/validate.py): a
    safetensors header within its size cap, of floating-point tensors whose byte ranges fill the
    file exactly; an index naming shards beside it. Any problem: one InputError naming the file."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: missing (download it again, or give the folder it is in)")
    name = p.name
    if name.endswith(".index.json"):
        weight_map = shard_names(read_json(p, what="shard index"), str(p))
        out: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            out.update(read_state(confine(p.parent / shard, p.parent)))
        missing = set(weight_map) - set(out)
        if missing:
            raise InputError(f"{p}: {len(missing)} tensors listed in the index are in no shard "
                             f"(e.g. {sorted(missing)[0]!r}); a shard is incomplete")
        return out
    if name.endswith(".safetensors"):
        from safetensors.torch import load_file

        safetensors_header(p, str(p))  # sizes and dtypes first: never map a file that lies about them
        try:
            return load_file(str(p), device="cpu")
        except Exception as e:  # noqa: BLE001 - safetensors' own error type is not importable by name
            raise InputError(f"{p}: cannot be read as a checkpoint ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200] if str(e) else ''}); the file is probably partial "
                             "or corrupt: download it again") from None
    if name.endswith((".pth", ".pt", ".bin", ".ckpt")):
        return read_pth(p)
    raise InputError(f"{p}: unknown checkpoint format (expected .safetensors, .index.json or .pth)")


def build_loaded(factory: Callable[[], nn.Module], state: Mapping[str, torch.Tensor], *,
                 what: str, dtype: torch.dtype | None = None, unused: Iterable[str] = (),
                 device: str | torch.device = "cpu") -> nn.Module:
    """`factory()` built on the meta device, filled in place with `state` (our keys, after the
    family's adapter). dtype None: each tensor as stored. unused: regexes of stored keys the network
    has no place for (skipped by name). `what` names the checkpoint in errors."""
    with torch.device("meta"):
        net = factory()
    expected = net.state_dict()
    skip = [re.compile(u) for u in unused]
    extra = [k for k in state if k not in expected and not any(rx.fullmatch(k) for rx in skip)]
    missing = [k for k in expected if k not in state]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {missing[0]!r})")
        if extra:
            parts.append(f"{len(extra)} unexpected (e.g. {extra[0]!r})")
        raise InputError(f"{what}: the weights do not fit this network: {'; '.join(parts)}; "
                         "is it the right family and variant, and complete?")
    for k, want in expected.items():
        got = state[k]
        if tuple(got.shape) != tuple(want.shape):
            raise InputError(f"{what}: {k!r} has shape {tuple(got.shape)}, the network expects "
                             f"{tuple(want.shape)} (another variant or size of the model?)")
    fill = {k: _checked(state[k], want, dtype, k, what) for k, want in expected.items()}
    net.load_state_dict(fill, strict=True, assign=True)
    init = getattr(net, "init_buffers_", None)
    if init is not None:
        init()
    left = [n for n, t in [*net.named_parameters(), *net.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"{what}: {left[0]!r} still has no data after loading (a buffer the "
                           "module's init_buffers_() should make)")
    return net.to(device)


def _checked(t: torch.Tensor, want: torch.Tensor, dtype: torch.dtype | None, key: str, what: str) -> torch.Tensor:
    """One stored tensor as it is assigned: of a floating type where the network's is (an int64
    or bool tensor would fail in the forward), cast to `dtype`, every value finite (a NaN or Inf
    weight renders black frames without an error). One pass over the tensor, as it is read."""
    if want.is_floating_point() != t.is_floating_point():
        raise InputError(f"{what}: {key!r} is stored as {t.dtype}, the network's is {want.dtype}: "
                         "not a weights file of this model")
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise InputError(f"{what}: {key!r} holds {bad:,} NaN or infinite value(s) (of {t.numel():,}): the "
                         "file is corrupt (or the weights diverged in training); download it again")
    return t
