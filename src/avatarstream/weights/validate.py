"""One validation path for what a weights folder holds besides tensors, used by `models check`
and by the loaders alike (so what the check passes, the loader loads, and what it refuses, the
loader refuses with the same line):

- `read_json`: a config, index or `avatarstream.json` read with a size cap, as an object, with
  every number finite (Python's json takes `NaN` and `Infinity`) and every integer bounded;
- `fields`: a family's schema, the types and sane ranges of the sizes a network is built from
  (`dim: 0`, `num_layers: 1e6` or a string are refused before a module is built, even on the
  meta device: building a million layers takes minutes);
- `sidecar`: our optional `avatarstream.json` (video size, the Wan VAE's kwargs);
- `confine`: a file must resolve inside the folder it was looked for in (a link out of a weights
  folder, or an index naming `../x`, is refused unless AVATARSTREAM_FOLLOW_LINKS=1).

Each problem is one `Bad` (an InputError) naming the file and what is wrong. Tensor headers
(names, dtypes, shapes, byte ranges) are weights/headers.py's.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from avatarstream.errors import InputError

MAX_JSON = 16 << 20  # bytes: the 14 B DiT's shard index is ~100 KB, a config ~1 KB
MAX_INT = 1 << 53  # JSON's exact integers; an index's total_size is 3e10 for the 14 B DiT
MAX_SIDE = 2048  # pixels: a video side from avatarstream.json (the releases run 512 and 720x400)
FOLLOW_LINKS = "AVATARSTREAM_FOLLOW_LINKS"


class Bad(InputError):
    """One problem with one file that stops its check (the message names the file)."""


def _numbers(value: Any, shown: str, where: str = "") -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise Bad(f"{shown}: {where or 'a value'} is {value}, not a finite number: corrupt, download it again")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= MAX_INT:
        raise Bad(f"{shown}: {where or 'a value'} is {value}, beyond any size a file describes")
    if isinstance(value, Mapping):
        for k, v in value.items():
            _numbers(v, shown, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _numbers(v, shown, f"{where}[{i}]")


def read_json(path: Path, shown: str | None = None, *, what: str = "config") -> dict[str, Any]:
    """The JSON object in `path`: Bad when it is missing, larger than MAX_JSON, not JSON, not an
    object, or holds a non-finite or unbounded number."""
    shown = shown or str(path)
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise OSError("not a file")
        if size > MAX_JSON:
            raise Bad(f"{shown}: {size:,} bytes, too large for a {what} (at most {MAX_JSON:,}): corrupt")
        raw = json.loads(path.read_bytes())
        if not isinstance(raw, dict):
            raise Bad(f"{shown}: a JSON {type(raw).__name__}, not a {what} object: download it again")
        _numbers(raw, shown)
    except RecursionError:
        raise Bad(f"{shown}: nested too deeply for a {what}: corrupt") from None
    except FileNotFoundError:
        raise Bad(f"{shown}: missing (download it again)") from None
    except OSError as e:
        raise Bad(f"{shown}: cannot be read ({e.strerror or e})") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise Bad(f"{shown}: not JSON ({e}): download it again") from None
    return raw


# -- schemas: field -> (kind, low, high); kinds "int", "float", "bool", "str", "ints", "floats", "bools"
Schema = Mapping[str, tuple[str, float, float]]

FLASHHEAD_DIT: Schema = {
    "in_dim": ("int", 1, 1024), "out_dim": ("int", 1, 1024), "dim": ("int", 2, 16384),
    "num_layers": ("int", 1, 128), "num_heads": ("int", 1, 256), "ffn_dim": ("int", 1, 65536),
    "freq_dim": ("int", 2, 4096), "eps": ("float", 0, 1), "patch_size": ("ints", 1, 16),
    "vae_stride": ("ints", 1, 64), "text_dim": ("int", 1, 16384), "text_len": ("int", 1, 4096),
    "has_image_input": ("bool", 0, 1)}
FLASHHEAD_REQUIRED = ("in_dim", "out_dim", "dim", "num_layers", "num_heads", "ffn_dim", "freq_dim", "eps",
                      "patch_size", "vae_stride")
LIVEAVATAR_DIT: Schema = {
    **FLASHHEAD_DIT, "audio_dim": ("int", 1, 16384), "num_audio_token": ("int", 1, 1024),
    "cond_dim": ("int", 0, 1024), "motion_token_num": ("int", 1, 65536), "audio_inject_layers": ("ints", 0, 127),
    "window_size": ("ints", -1, 1 << 20), "local_attn_size": ("int", -1, 1 << 20)}
WAN_VAE: Schema = {"dim": ("int", 1, 1024), "z_dim": ("int", 1, 256), "dim_mult": ("ints", 1, 16),
                   "num_res_blocks": ("int", 1, 16), "attn_scales": ("floats", 0, 1),
                   "temperal_downsample": ("bools", 0, 1), "dropout": ("float", 0, 1)}
LTX_VAE: Schema = {"in_channels": ("int", 1, 64), "out_channels": ("int", 1, 64), "latent_channels": ("int", 1, 1024),
                   "patch_size": ("int", 1, 64), "patch_size_t": ("int", 1, 64), "block_out_channels": ("ints", 1, 4096),
                   "layers_per_block": ("ints", 0, 64), "decoder_block_out_channels": ("ints", 1, 4096),
                   "decoder_layers_per_block": ("ints", 0, 64), "resnet_norm_eps": ("float", 0, 1)}
WAV2VEC2: Schema = {"hidden_size": ("int", 1, 8192), "num_hidden_layers": ("int", 1, 128),
                    "num_attention_heads": ("int", 1, 256), "intermediate_size": ("int", 1, 65536),
                    "conv_dim": ("ints", 1, 8192), "conv_kernel": ("ints", 1, 1024), "conv_stride": ("ints", 1, 1024),
                    "num_conv_pos_embeddings": ("int", 1, 4096), "num_conv_pos_embedding_groups": ("int", 1, 1024),
                    "layer_norm_eps": ("float", 0, 1), "conv_bias": ("bool", 0, 1),
                    "do_stable_layer_norm": ("bool", 0, 1), "num_feat_extract_layers": ("int", 1, 64)}
SIDECAR: Schema = {"size": ("int", 16, MAX_SIDE), "height": ("int", 16, MAX_SIDE), "width": ("int", 16, MAX_SIDE)}
MAX_LIST = 64  # entries of a list-valued size


def _ok(kind: str, v: Any, lo: float, hi: float) -> bool:
    if kind.endswith("s"):
        return isinstance(v, list) and 0 < len(v) <= MAX_LIST and all(_ok(kind[:-1], x, lo, hi) for x in v)
    if kind == "bool":
        return isinstance(v, bool)
    if kind == "str":
        return isinstance(v, str)
    if isinstance(v, bool) or not isinstance(v, int if kind == "int" else (int, float)):
        return False
    return lo <= v <= hi


def fields(raw: Mapping[str, Any], schema: Schema, shown: str, required: tuple[str, ...] = ()) -> None:
    """Bad naming the first field of `raw` that `schema` knows and whose value is of another type
    or out of its range, or the first `required` field missing."""
    for k in required:
        if k not in raw:
            raise Bad(f"{shown}: no {k!r}: not a complete config (download it again)")
    for k, (kind, lo, hi) in schema.items():
        if k in raw and not _ok(kind, raw[k], lo, hi):
            what = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}
            want = what.get(kind) or f"a list (1-{MAX_LIST} entries) of {what[kind[:-1]].split(' ', 1)[1]}s"
            rng = f" in {lo:g}..{hi:g}" if kind.rstrip("s") in ("int", "float") else ""
            raise Bad(f"{shown}: {k} is {json.dumps(raw[k])[:60]}, expected {want}{rng}")


def flashhead_dit(raw: Mapping[str, Any], shown: str) -> None:
    """A FlashHead DiT's config.json (WanModelAudioProject kwargs): sizes, and heads that split the width."""
    fields(raw, FLASHHEAD_DIT, shown, FLASHHEAD_REQUIRED)
    _heads(raw["dim"], raw["num_heads"], shown)
    if len(raw["patch_size"]) != 3 or len(raw["vae_stride"]) != 3:
        raise Bad(f"{shown}: patch_size and vae_stride need 3 entries (time, height, width)")


def liveavatar_dit(raw: Mapping[str, Any], shown: str) -> None:
    """Wan2.2-S2V-14B's config.json (WanModel_S2V kwargs; missing ones take the official defaults)."""
    fields(raw, LIVEAVATAR_DIT, shown)
    if "dim" in raw or "num_heads" in raw:
        _heads(raw.get("dim", 2048), raw.get("num_heads", 16), shown)


def _heads(dim: int, heads: int, shown: str) -> None:
    if dim % heads or (dim // heads) % 2:
        raise Bad(f"{shown}: dim {dim} does not split into {heads} heads of an even width")


def sidecar(path: Path) -> dict[str, Any]:
    """Our optional `avatarstream.json` ({} without one): size/height/width in 16..MAX_SIDE pixels,
    `wan_vae` a Wan VAE's constructor kwargs."""
    if not path.is_file():
        return {}
    raw = read_json(path, what="settings")
    fields(raw, SIDECAR, str(path))
    if ("height" in raw) != ("width" in raw):
        raise Bad(f"{path}: give height and width together (or size alone)")
    vae = raw.get("wan_vae", {})
    if not isinstance(vae, dict):
        raise Bad(f"{path}: wan_vae is {json.dumps(vae)[:60]}, expected the Wan VAE's kwargs (an object)")
    fields(vae, WAN_VAE, f"{path}: wan_vae")
    return raw


# -- where a file may be --------------------------------------------------------------------------
def _trusted(root: Path) -> Path:
    """The folder files under `root` (resolved) may resolve into: root, or, in a Hugging Face cache
    (`models--ORG--NAME/snapshots/REV/`, whose files link into `../../blobs/`), the whole repository folder."""
    for p in (root, *root.parents):
        if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
            return p.parent.parent
    return root


def under(path: Path, root: Path) -> bool:
    """Whether `path` is `root` or below it as written (links not followed)."""
    p, r = Path(os.path.abspath(path)), Path(os.path.abspath(root))
    return p == r or r in p.parents


def confine(path: Path, root: Path, shown: str | None = None) -> Path:
    """`path`, refused (Bad) when it resolves outside `root`, the folder it was looked for in (a
    link to elsewhere, `..` in an index): a weights folder is trusted with its own files only.
    AVATARSTREAM_FOLLOW_LINKS=1 lifts this for folders assembled from links on purpose."""
    if os.environ.get(FOLLOW_LINKS) == "1":
        return path
    real, top = path.resolve(), _trusted(root.resolve())
    if real != top and top not in real.parents:
        raise Bad(f"{shown or path}: resolves to {real}, outside {root}: refused (a weights folder is read only "
                  f"inside itself; set {FOLLOW_LINKS}=1 to follow links out of it)")
    return path


def shard_names(index: Mapping[str, Any], shown: str) -> dict[str, str]:
    """A sharded checkpoint's `weight_map` (key -> shard file name), each name a plain file name
    (no folder, no `..`): Bad otherwise."""
    wm = index.get("weight_map")
    if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
        raise Bad(f"{shown}: not a shard index (no weight_map of tensor names to shard files): download it again")
    for v in set(wm.values()):
        if not v or Path(v).name != v or v in (".", "..") or "\\" in v:
            raise Bad(f"{shown}: names the shard {v!r}, not a file beside it: refused")
    return dict(wm)
