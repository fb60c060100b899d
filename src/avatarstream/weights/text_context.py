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


def read_context(path: str | Path, *, dim: int | None = None) -> torch.Tensor:
    """The context `[L, dim]` of a file written by `encode-text`, as stored; InputError naming the
    file when it is missing, not such a file, or (given `dim`) for a text encoder of another width."""
    p = Path(path)
    meta, tensors = _read(p)
    if meta.get("format") != FORMAT:
        raise InputError(f"{p}: not a text context file (metadata format {meta.get('format')!r}, expected "
                         f"{FORMAT!r}); make one with `avatarstream models encode-text`")
    ctx = tensors.get(KEY)
    if ctx is None or ctx.ndim != 2 or ctx.shape[0] == 0:
        raise InputError(f"{p}: holds no [L, dim] {KEY!r} tensor; make it again with `avatarstream models "
                         "encode-text`")
    if dim is not None and ctx.shape[1] != dim:
        raise InputError(f"{p}: context width {ctx.shape[1]}, this model's text encoder gives {dim} "
                         "(made with another text encoder?)")
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
