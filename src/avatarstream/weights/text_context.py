"""A precomputed text context: the umT5 output for one prompt, as a file the DiT reads at run time.

LiveAvatar runs without classifier-free guidance, so one prompt's umT5-XXL output is all the DiT ever
needs from the 5.7 B-parameter text encoder. `avatarstream models encode-text` computes it once and
writes it here; a session then reads `[L, 4096]` and never loads the encoder (docs/real-models.md, LiveAvatar's "Generate").

The file is one safetensors tensor `context` `[L, dim]` (L = the prompt's true token count, eos
included, at most 512; the DiT zero-pads to its text length itself) in the dtype it was computed in,
and string metadata: `format` (`FORMAT`), `prompt`, `tokens`, `dim`, `dtype`, `token_ids` (JSON),
`t5_sha256` and `tokenizer_sha256` (which encoder and tokenizer made it). It is written beside its
final name and renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from avatarstream.errors import InputError, OutputError

FORMAT = "avatarstream-text-context/1"
KEY = "context"
FILE = "context.safetensors"  # a LiveAvatar folder's default prompt context
MAX_TOKENS = 512  # umT5's text length: a context has at most this many rows


def check_out(path: str | Path) -> Path:
    """`path` as a Path when a context file can be written there: checked before the encoder loads."""
    p = Path(path)
    if p.is_dir():
        raise OutputError(f"--out {p} is a folder; give a file such as {p / 'context.safetensors'}")
    if not p.parent.is_dir():
        raise OutputError(f"--out {p}: the folder {p.parent} does not exist")
    if not os.access(p.parent, os.W_OK | os.X_OK):
        raise OutputError(f"--out {p}: the folder {p.parent} is not writable")
    return p


def write_context(path: str | Path, context: torch.Tensor, metadata: Mapping[str, str]) -> Path:
    """Write context `[L, dim]` and its metadata atomically (a temporary file beside, then rename)."""
    from safetensors.torch import save_file

    p = check_out(path)
    if context.ndim != 2 or context.shape[0] == 0:
        raise ValueError(f"a text context is [L, dim] with L >= 1, got {tuple(context.shape)}")
    meta = {**metadata, "format": FORMAT, "tokens": str(context.shape[0]), "dim": str(context.shape[1]),
            "dtype": str(context.dtype).removeprefix("torch.")}
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        save_file({KEY: context.detach().cpu().contiguous()}, str(tmp), metadata=meta)
        os.replace(tmp, p)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OutputError(f"cannot write the text context {p}: {e.strerror or e}") from None
    return p


def check_context(path: str | Path, *, dim: int | None = None, max_tokens: int = MAX_TOKENS,
                  root: Path | None = None) -> tuple[int, int]:
    """`(L, width)` of a context file from its header alone, through the weights files' checks
    (weights/headers.py, weights/validate.py: the header's size capped, the file exactly as long
    as it says, a floating-point dtype; inside `root` when given): one tensor `context`
    `[L, width]` with 1 <= L <= max_tokens (and width == dim when given). InputError naming the
    file otherwise (a partial download, another file, a context of another text encoder)."""
    from avatarstream.weights.headers import WEIGHT_DTYPES, safetensors_header
    from avatarstream.weights.validate import Bad, confine

    p = Path(path)
    if root is not None:
        confine(p, root)
    if not p.is_file():
        raise InputError(f"{p}: no such text context file (make one with `avatarstream models encode-text`)")
    try:
        table = safetensors_header(p, str(p), weights=False)
    except OSError as e:
        raise InputError(f"{p}: cannot be read ({e.strerror or e})") from None
    except Bad as e:  # a partial download, a header too large or not JSON
        raise InputError(f"{p}: not a readable safetensors file: {str(e).removeprefix(f'{p}: ')}") from None
    shape = table[KEY].shape if set(table) == {KEY} else None
    if shape is None or len(shape) != 2 or not 1 <= shape[0] <= max_tokens or shape[1] == 0:
        got = ", ".join(f"{k!r} {list(v.shape)}" for k, v in list(table.items())[:3]) or "no tensor"
        raise InputError(f"{p}: not a text context file (holds {got}; expected one {KEY!r} [L, width] with L "
                         f"in 1..{max_tokens}): make it again with `avatarstream models encode-text`")
    if table[KEY].dtype not in WEIGHT_DTYPES:
        raise InputError(f"{p}: the context is stored as {table[KEY].dtype}, not floating point "
                         f"({'/'.join(sorted(WEIGHT_DTYPES))}): make it again with `avatarstream models encode-text`")
    if dim is not None and shape[1] != dim:
        raise InputError(f"{p}: context width {shape[1]}, this model's text encoder gives {dim} "
                         "(made with another text encoder?)")
    return shape[0], shape[1]


def read_context(path: str | Path, *, dim: int | None = None, max_tokens: int = MAX_TOKENS,
                 root: Path | None = None) -> torch.Tensor:
    """The context `[L, dim]` of a file written by `encode-text`, as stored; InputError naming the
    file when it is missing, not such a file (`check_context`), or holds NaN/Inf."""
    p = Path(path)
    check_context(p, dim=dim, max_tokens=max_tokens, root=root)
    meta, tensors = _read(p)
    if meta.get("format") != FORMAT:
        raise InputError(f"{p}: not a text context file (metadata format {meta.get('format')!r}, expected "
                         f"{FORMAT!r}); make one with `avatarstream models encode-text`")
    ctx = tensors[KEY]
    if not torch.isfinite(ctx).all():
        raise InputError(f"{p}: the context holds NaN or infinite values: corrupt, make it again with "
                         "`avatarstream models encode-text`")
    return ctx


def read_metadata(path: str | Path) -> dict[str, str]:
    """The metadata of a text context file (prompt, hashes, ...), checked like `read_context`."""
    read_context(path)
    return _read(Path(path))[0]


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    """sha256 of one file, read in 16 MB pieces (the 11 GB encoder never sits in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def folder_sha256(folder: Path) -> str:
    """sha256 over a folder's files (names and contents, sorted by name; not recursive)."""
    h = hashlib.sha256()
    for f in sorted(q for q in folder.iterdir() if q.is_file()):
        h.update(json.dumps([f.name, file_sha256(f)]).encode())
    return h.hexdigest()


def _read(p: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    if not p.is_file():
        raise InputError(f"{p}: no such text context file (make one with `avatarstream models encode-text`)")
    try:
        with safe_open(str(p), framework="pt") as f:
            return dict(f.metadata() or {}), {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise InputError(f"{p}: not a readable safetensors file ({e})") from None
