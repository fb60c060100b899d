"""Wan's umT5-XXL text encoder, loaded from its own `.pth` into `transformers`' `UMT5EncoderModel`.

Wan ships the encoder half of umT5-XXL as `models_t5_umt5-xxl-enc-bf16.pth`, a state dict of its own
`T5Encoder` class (Wan2.2 `wan/modules/t5.py`): 242 bf16 tensors, 5.681 B parameters. We do not
keep a port of that network: it is `transformers`' UMT5 encoder under other names (per-block
relative position bias, gated GELU-tanh FFN, RMS norms, no attention scaling), so `WAN_UMT5` is a
`StateDictAdapter` that renames the keys and a maintained model class does the arithmetic. On a
tiny random encoder the official code and this loader agree to 0.0 on padded, masked input and to
1.2e-6 on the trimmed input `encode-text` runs (fp32; tests/fixtures/golden/umt5-a.safetensors),
and bit for bit in bf16 both ways (transformers 4.51.3, which Wan pins, and 5.24).

Eager attention is pinned: it takes the softmax in fp32 over bf16 scores exactly as Wan does, where
SDPA (transformers 5.x default) lands 6.6e-6 away in fp32. A prompt is at most 512 tokens, so its cost is
nothing next to the 5.7 B-parameter matmuls.

Loading is the house way (weights/official.py): the `.pth` is memory-mapped (`weights_only`), the
model is built on the meta device and filled in place, each tensor cast once (bf16 by default: the
file's own dtype, so nothing is copied on CPU). `transformers` keeps the token embedding under two
names (`shared`, `encoder.embed_tokens`); both point at the one stored tensor, and the model is
re-tied before it moves to a device so the 2.1 GB table is never copied twice.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from avatarstream.errors import ConfigError, InputError
from avatarstream.weights.adapters import KeyRule, StateDictAdapter
from avatarstream.weights.liveavatar_folder import BASE_DIR, T5_FILE, TOKENIZER_DIR
from avatarstream.weights.official import build_loaded, read_state
from avatarstream.weights.text_context import check_out, file_sha256, folder_sha256, write_context

NET = "umt5"
TEXT_LEN = 512  # Wan's text_len: the tokenizer truncates there (the eos token included)
MAX_DISTANCE = 128  # T5RelativeEmbedding's max_dist, not a constructor argument of the encoder
EXTRA = "pip install 'avatarstream[real]'"
TOKENIZER_FILES = ("tokenizer.json", "spiece.model")  # either one is a complete umT5 tokenizer

_BLOCK = r"blocks\.(\d+)\."
_LAYER = r"encoder.block.\1.layer."
WAN_UMT5 = StateDictAdapter("wan-umt5", rules=(
    KeyRule(NET, r"token_embedding\.weight", "encoder.embed_tokens.weight"),
    KeyRule(NET, r"norm\.weight", "encoder.final_layer_norm.weight"),
    KeyRule(NET, _BLOCK + r"norm1\.weight", _LAYER + r"0.layer_norm.weight"),
    KeyRule(NET, _BLOCK + r"attn\.([qkvo])\.weight", _LAYER + r"0.SelfAttention.\2.weight"),
    KeyRule(NET, _BLOCK + r"pos_embedding\.embedding\.weight",
            _LAYER + r"0.SelfAttention.relative_attention_bias.weight"),
    KeyRule(NET, _BLOCK + r"norm2\.weight", _LAYER + r"1.layer_norm.weight"),
    KeyRule(NET, _BLOCK + r"ffn\.gate\.0\.weight", _LAYER + r"1.DenseReluDense.wi_0.weight"),  # GELU branch
    KeyRule(NET, _BLOCK + r"ffn\.fc1\.weight", _LAYER + r"1.DenseReluDense.wi_1.weight"),  # linear branch
    KeyRule(NET, _BLOCK + r"ffn\.fc2\.weight", _LAYER + r"1.DenseReluDense.wo.weight"),
))
BLOCK_KEYS = ("norm1.weight", "attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.o.weight",
              "norm2.weight", "ffn.gate.0.weight", "ffn.fc1.weight", "ffn.fc2.weight",
              "pos_embedding.embedding.weight")  # 10 tensors a block in Wan's T5Encoder

# umt5_xxl(encoder_only=True): the official T5Encoder kwargs of the released file
XXL = {"vocab": 256384, "dim": 4096, "dim_attn": 4096, "dim_ffn": 10240, "num_heads": 64,
       "num_layers": 24, "num_buckets": 32, "shared_pos": False, "dropout": 0.1}


def wan_keys(num_layers: int) -> list[str]:
    """Every key of Wan's umT5 encoder file with `num_layers` blocks (242 for XXL)."""
    return ["token_embedding.weight", *(f"blocks.{i}.{k}" for i in range(num_layers) for k in BLOCK_KEYS),
            "norm.weight"]


def kwargs_from_state(state: Mapping[str, torch.Tensor], *, what: str) -> dict[str, Any]:
    """The official T5Encoder kwargs that built `state`, read from its shapes (the file has no config)."""
    if "pos_embedding.embedding.weight" in state:
        raise InputError(f"{what}: one position bias shared by all blocks: a T5 encoder, not Wan's umT5 "
                         "(whose blocks each have their own)")
    need = ("token_embedding.weight", "blocks.0.attn.q.weight", "blocks.0.ffn.fc1.weight",
            "blocks.0.pos_embedding.embedding.weight")
    missing = [k for k in need if k not in state]
    if missing:
        raise InputError(f"{what}: no {missing[0]!r}: not Wan's umT5 encoder file "
                         f"(models_t5_umt5-xxl-enc-bf16.pth)")
    vocab, dim = state["token_embedding.weight"].shape
    blocks = {int(m.group(1)) for k in state if (m := re.match(r"blocks\.(\d+)\.", k))}
    buckets, heads = state["blocks.0.pos_embedding.embedding.weight"].shape
    return {"vocab": int(vocab), "dim": int(dim), "dim_attn": int(state["blocks.0.attn.q.weight"].shape[0]),
            "dim_ffn": int(state["blocks.0.ffn.fc1.weight"].shape[0]), "num_heads": int(heads),
            "num_layers": max(blocks) + 1, "num_buckets": int(buckets), "shared_pos": False, "dropout": 0.1}


def umt5_config(official: Mapping[str, Any]) -> Any:
    """Wan's T5Encoder kwargs -> a `transformers` UMT5Config of the same encoder (eager attention,
    no dropout: inference)."""
    UMT5Config = _transformers().UMT5Config
    try:
        if official.get("shared_pos", False):
            raise ValueError("shared_pos=True is the original T5's one shared bias; umT5 has one a block")
        heads, dim_attn = int(official["num_heads"]), int(official["dim_attn"])
        if dim_attn % heads:
            raise ValueError(f"dim_attn {dim_attn} is not a multiple of num_heads {heads}")
        return UMT5Config(vocab_size=int(official["vocab"]), d_model=int(official["dim"]), d_kv=dim_attn // heads,
                          d_ff=int(official["dim_ffn"]), num_layers=int(official["num_layers"]), num_heads=heads,
                          relative_attention_num_buckets=int(official["num_buckets"]),
                          relative_attention_max_distance=MAX_DISTANCE, dropout_rate=0.0, layer_norm_epsilon=1e-6,
                          feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
                          attn_implementation="eager")
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"not a Wan umT5 encoder config ({type(e).__name__}: {e})") from None


def load_umt5(state: Mapping[str, torch.Tensor], official: Mapping[str, Any] | None = None, *,
              what: str = "umT5 encoder", dtype: torch.dtype = torch.bfloat16,
              device: str | torch.device = "cpu") -> nn.Module:
    """A `UMT5EncoderModel` filled in place from a Wan umT5 state dict (official keys); official:
    the T5Encoder kwargs (None: read from the shapes). InputError naming the Wan key when the file
    is not this network or not complete."""
    official = dict(official) if official is not None else kwargs_from_state(state, what=what)
    cfg = umt5_config(official)
    want = wan_keys(int(official["num_layers"]))
    missing, extra = [k for k in want if k not in state], sorted(set(state) - set(want))
    if missing or extra:
        parts = ([f"{len(missing)} missing (e.g. {missing[0]!r})"] if missing else []) + \
                ([f"{len(extra)} unexpected (e.g. {extra[0]!r})"] if extra else [])
        raise InputError(f"{what}: not Wan's umT5 encoder with {official['num_layers']} blocks: "
                         f"{'; '.join(parts)}")
    cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}  # once per tensor
    mapped = WAN_UMT5.state_dict(NET, cast)
    mapped["shared.weight"] = mapped["encoder.embed_tokens.weight"]  # transformers' second name for it
    net = build_loaded(lambda: _transformers().UMT5EncoderModel(cfg), mapped, what=what)
    net.set_input_embeddings(net.encoder.embed_tokens)  # one table, before any copy to a device
    return net.to(device).eval().requires_grad_(False)


def clean_prompt(prompt: str) -> str:
    """Wan's `clean='whitespace'`: ftfy's text fixes (mojibake, curly quotes, width forms), HTML
    entities undone twice, whitespace runs -> one space, stripped."""
    text = html.unescape(html.unescape(_ftfy().fix_text(prompt))).strip()
    return re.sub(r"\s+", " ", text).strip()


def load_tokenizer(folder: str | Path) -> Any:
    """The `google/umt5-xxl` tokenizer folder (tokenizer.json, or spiece.model with sentencepiece)
    through `AutoTokenizer`, as Wan loads it; read locally, never downloaded."""
    d = Path(folder)
    if not d.is_dir():
        raise InputError(f"{d}: no such tokenizer folder (the google/umt5-xxl folder of the download)")
    if not any((d / f).is_file() for f in TOKENIZER_FILES):
        raise InputError(f"{d}: none of {', '.join(TOKENIZER_FILES)}: not the google/umt5-xxl tokenizer folder")
    try:
        return _transformers().AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise InputError(f"{d}: not a readable tokenizer folder ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None


def prompt_ids(tokenizer: Any, prompt: str, *, text_len: int = TEXT_LEN) -> tuple[torch.Tensor, bool]:
    """The cleaned prompt's token ids `[L]` (L <= text_len, the eos token last, as Wan's tokenizer
    call gives them before padding) and whether it was truncated."""
    text = clean_prompt(prompt)
    if not text:
        raise ConfigError("--prompt is empty: give the text the avatar's video should follow")
    full = tokenizer([text], add_special_tokens=True)["input_ids"][0]
    ids = tokenizer([text], add_special_tokens=True, truncation=True, max_length=text_len)["input_ids"][0]
    return torch.tensor(ids, dtype=torch.long), len(full) > len(ids)


@torch.inference_mode()
def encode_ids(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """ids `[L]` -> context `[L, dim]`. Run on the true length alone: Wan runs 512 padded positions
    with a mask and trims, which is the same sum (fp32: 1.2e-6 apart) at a fraction of the cost."""
    device = next(model.parameters()).device
    return model(input_ids=ids[None].to(device)).last_hidden_state[0]  # [L, dim]


def locate(ckpt: str | Path) -> tuple[Path, Path]:
    """(encoder .pth, tokenizer folder) in a Wan2.2-S2V-14B download: DIR itself, or the folder
    LiveAvatar's `ckpt/` holds it in (DIR/Wan2.2-S2V-14B)."""
    d = Path(ckpt)
    for base in (d, d / BASE_DIR):
        if (base / T5_FILE).is_file() or (base / TOKENIZER_DIR).is_dir():
            return base / T5_FILE, base / TOKENIZER_DIR
    raise InputError(f"--ckpt {d}: neither {T5_FILE} nor {TOKENIZER_DIR}/ is in it or in {d / BASE_DIR}; "
                     "give the Wan2.2-S2V-14B folder, or --t5 and --tokenizer")


def encode_text(prompt: str, *, t5: str | Path, tokenizer: str | Path, out: str | Path,
                dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> dict[str, Any]:
    """Tokenize `prompt`, run the umT5 encoder once, write the `[L, dim]` context file (text_context.py).
    The cheap checks (files there, prompt not empty) come before the 11 GB load."""
    t5_path, tok_dir = Path(t5), Path(tokenizer)
    check_out(out)
    if not t5_path.is_file():
        raise InputError(f"{t5_path}: no such umT5 encoder file (Wan's {T5_FILE})")
    tok = load_tokenizer(tok_dir)
    ids, truncated = prompt_ids(tok, prompt)
    model = load_umt5(read_state(t5_path), what=str(t5_path), dtype=dtype, device=device)
    vocab = model.get_input_embeddings().num_embeddings
    if int(ids.max()) >= vocab:
        raise InputError(f"{tok_dir}: token id {int(ids.max())} is past the encoder's {vocab}-row embedding: "
                         "the tokenizer does not belong to this encoder")
    context = encode_ids(model, ids)  # [L, dim]
    meta = {"prompt": prompt, "token_ids": json.dumps(ids.tolist()), "t5_sha256": file_sha256(t5_path),
            "tokenizer_sha256": folder_sha256(tok_dir)}
    path = write_context(out, context, meta)
    return {"out": str(path), "tokens": int(context.shape[0]), "dim": int(context.shape[1]),
            "dtype": str(context.dtype).removeprefix("torch."), "truncated": truncated}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"the umT5 text encoder needs `transformers`: {EXTRA}") from None
    return transformers


def _ftfy() -> Any:
    try:
        import ftfy
    except ImportError:
        raise ConfigError(f"the prompt clean-up Wan applies needs `ftfy`: {EXTRA}") from None
    return ftfy
