"""A checkpoint file's table of tensors (names, dtypes, shapes) without reading the tensors.

Why: a downloaded checkpoint weighs gigabytes, and whether it is complete and of the right network
can be told from its first kilobytes. A safetensors file starts with an 8-byte little-endian
length and a JSON table of every tensor's dtype, shape and byte range, so the size the file must
have follows from the header (a partial download is shorter than its header says). A `.pth` is a
zip that `torch.load(mmap=True, weights_only=True)` maps without reading its storages
(`official.read_state`); a truncated one has lost the zip's directory at its end.
"""

from __future__ import annotations

import json
import math
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from avatarstream.errors import InputError
from avatarstream.weights.validate import MAX_JSON, Bad

# bytes: a 14 B model's header is a few hundred KB; safetensors itself refuses 100 MB, so a header
# between the two would pass a check and fail the load
MAX_HEADER = MAX_JSON
WEIGHT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})  # what a network's weights may be stored as
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
            "I16": 2, "I8": 1, "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1}
TORCH_DTYPE = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
               torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


@dataclass(frozen=True)
class Stored:
    """A tensor as a file's header describes it."""

    dtype: str  # safetensors' spelling: F32, BF16, ...
    shape: tuple[int, ...]


def _dtypes(out: dict[str, Stored], shown: str) -> dict[str, Stored]:
    odd = [k for k, s in out.items() if s.dtype not in WEIGHT_DTYPES]
    if odd:
        raise Bad(f"{shown}: {len(odd)} tensor(s) stored as {out[odd[0]].dtype} (e.g. {odd[0]!r}); weights are "
                  f"{'/'.join(sorted(WEIGHT_DTYPES))}: not a weights file of this model")
    return out


def safetensors_header(path: Path, shown: str, *, weights: bool = True) -> dict[str, Stored]:
    """Dtype and shape of every tensor of a safetensors file from its header alone; Bad when the
    file is shorter or longer than the header says, the header is not one, or (weights) a tensor
    is not floating point. The loaders read a file only after this passed (official.read_state)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or 8 + n > size:
            raise Bad(f"{shown}: {size:,} bytes, but its header alone claims {max(n, 0) + 8:,}: a partial "
                      "download (download it again)")
        if n > MAX_HEADER:
            raise Bad(f"{shown}: a {n:,}-byte header is not a safetensors header: corrupt, download it again")
        try:
            table = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise Bad(f"{shown}: the header is not JSON ({str(e)[:100]}): corrupt, download it again") from None
    if not isinstance(table, dict):
        raise Bad(f"{shown}: the header is not a table of tensors: corrupt, download it again")
    out: dict[str, Stored] = {}
    end, wrong = 0, []
    for key, info in table.items():
        if key == "__metadata__":
            continue
        try:
            shape, offsets = info["shape"], info["data_offsets"]
            if not all(type(v) is int and 0 <= v < 1 << 48 for v in [*shape, *offsets]) or len(offsets) != 2:
                raise ValueError("not sizes")
            begin, stop = offsets
            item = ITEMSIZE[info["dtype"]]
            shape = tuple(shape)
        except (KeyError, TypeError, ValueError):
            raise Bad(f"{shown}: tensor {key!r} has a malformed header entry: corrupt, download it "
                      "again") from None
        if stop - begin != math.prod(shape) * item or begin > stop:
            wrong.append(key)
        end = max(end, stop)
        out[key] = Stored(info["dtype"], shape)
    if not isinstance(table.get("__metadata__", {}), dict):
        raise Bad(f"{shown}: the header's __metadata__ is not a table: corrupt, download it again")
    if wrong:
        raise Bad(f"{shown}: {len(wrong)} tensor(s) whose byte range does not match their shape and "
                  f"dtype (e.g. {wrong[0]!r}): corrupt, download it again")
    if 8 + n + end != size:
        why = "a partial download (download it again)" if size < 8 + n + end else "extra bytes: corrupt"
        raise Bad(f"{shown}: {size:,} bytes on disk, its header describes {8 + n + end:,}: {why}")
    return _dtypes(out, shown) if weights else out


def read_pth(path: Path) -> dict[str, torch.Tensor]:
    """A `.pth`/`.bin` state dict, memory-mapped, through torch's weights-only unpickler: a file
    that holds anything but tensors and plain containers (a pickled object, code) is refused with
    an InputError, never unpickled."""
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:  # torch's text suggests weights_only=False: exactly what not to do
        raise InputError(f"{path}: holds Python objects besides tensors (a pickle payload); refused, it is "
                         "never unpickled: use the file from the official release") from None
    except (RuntimeError, ValueError, OSError, EOFError, KeyError, TypeError, AttributeError) as e:
        raise InputError(f"{path}: cannot be read as a checkpoint ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200] if str(e) else ''}); the file is probably partial or "
                         "corrupt: download it again") from None
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping):
        raise InputError(f"{path}: holds a {type(obj).__name__}, not a state dict")
    return dict(obj)


def pth_tensors(path: Path, shown: str) -> dict[str, Stored]:
    """Dtype and shape of every tensor of a `.pth`, memory-mapped (no storage is read); Bad when a
    tensor's storage is shorter than its shape needs, or a tensor is not floating point."""
    try:
        state = read_pth(path)
    except InputError as e:
        raise Bad(str(e).replace(str(path), shown, 1)) from None
    out: dict[str, Stored] = {}
    for key, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise Bad(f"{shown}: {key!r} is a {type(t).__name__}, not a tensor: not a weights file")
        last = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
        if t.numel() and (t.is_meta or t.untyped_storage().nbytes() < (last + 1) * t.element_size()):
            raise Bad(f"{shown}: {key!r} has less data than its shape {tuple(t.shape)} needs: "
                      "corrupt, download it again")
        out[key] = Stored(TORCH_DTYPE.get(t.dtype, str(t.dtype)), tuple(t.shape))
    return _dtypes(out, shown)
