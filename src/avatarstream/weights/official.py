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

import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from avatarstream.errors import InputError


def read_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of one checkpoint file (or sharded index), memory-mapped where the format allows."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: missing (download it again, or give the folder it is in)")
    name = p.name
    try:
        if name.endswith(".index.json"):
            index = json.loads(p.read_text())
            shards = sorted(set(index["weight_map"].values()))
            out: dict[str, torch.Tensor] = {}
            for shard in shards:
                out.update(read_state(p.parent / shard))
            missing = set(index["weight_map"]) - set(out)
            if missing:
                raise InputError(f"{p}: {len(missing)} tensors listed in the index are in no shard "
                                 f"(e.g. {sorted(missing)[0]!r}); a shard is incomplete")
            return out
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(str(p), device="cpu")
        if name.endswith((".pth", ".pt", ".bin", ".ckpt")):
            obj = torch.load(str(p), map_location="cpu", weights_only=True, mmap=True)
            if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
                obj = obj["state_dict"]
            if not isinstance(obj, Mapping):
                raise InputError(f"{p}: holds a {type(obj).__name__}, not a state dict")
            return dict(obj)
    except InputError:
        raise
    except (KeyError, ValueError, RuntimeError, OSError, EOFError, json.JSONDecodeError) as e:
        raise InputError(f"{p}: cannot be read as a checkpoint ({type(e).__name__}: {e}); the file "
                         "is probably partial or corrupt: download it again") from None
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
    fill = {k: (state[k] if dtype is None or not state[k].is_floating_point() else state[k].to(dtype))
            for k in expected}
    net.load_state_dict(fill, strict=True, assign=True)
    init = getattr(net, "init_buffers_", None)
    if init is not None:
        init()
    left = [n for n, t in [*net.named_parameters(), *net.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"{what}: {left[0]!r} still has no data after loading (a buffer the "
                           "module's init_buffers_() should make)")
    return net.to(device)
