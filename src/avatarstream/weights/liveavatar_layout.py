"""Where each file of a LiveAvatar download is (weights/liveavatar_folder.py describes the layout
and loads it; weights/check_liveavatar.py checks it): the names, `locate`, `is_download`,
`parse_name` and the DiT's config, which both the check and the loader read (so neither
imports the other's module)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from avatarstream.errors import ConfigError, InputError
from avatarstream.models.liveavatar.config import LiveAvatarConfig
from avatarstream.weights.adapters import StateDictAdapter
from avatarstream.weights.validate import Bad, confine, liveavatar_dit, read_json, sidecar, under

BASE_DIR, LORA_DIR, LORA_FILE = "Wan2.2-S2V-14B", "LiveAvatar", "liveavatar.safetensors"
DIT_FILE = "diffusion_pytorch_model.safetensors"  # sharded: 4 shards and INDEX_FILE
INDEX_FILE = f"{DIT_FILE}.index.json"
SHARDS = 4
VAE_FILE, W2V_DIR = "Wan2.1_VAE.pth", "wav2vec2-large-xlsr-53-english"
T5_FILE, TOKENIZER_DIR = "models_t5_umt5-xxl-enc-bf16.pth", "google/umt5-xxl"
SIDECAR, CLASS_NAME, PREFIX = "avatarstream.json", "WanModel_S2V", "liveavatar:"
LIVEAVATAR = StateDictAdapter("liveavatar")  # identity: our DiT's keys are the official ones


@dataclass(frozen=True)
class LiveAvatarFolder:
    """Where each file of a LiveAvatar download is (not checked: `check_liveavatar`, `parse_name`)."""

    base: Path  # Wan2.2-S2V-14B/
    lora: Path  # liveavatar.safetensors
    wav2vec: Path  # wav2vec2-large-xlsr-53-english/

    @property
    def root(self) -> Path:
        return self.base.parent

    @property
    def index(self) -> Path:
        return self.base / INDEX_FILE

    @property
    def vae(self) -> Path:
        return self.base / VAE_FILE

    def extra(self) -> dict[str, Any]:
        """ROOT/avatarstream.json, checked (validate.sidecar); {} without one."""
        return sidecar(confine(self.root / SIDECAR, self.root))

    def trusted(self, folder: Path) -> Path:
        """The folder whose inside `folder`'s files may resolve to: ROOT for its own folders, else
        (a `lora=` or `wav2vec=` given elsewhere) that folder itself."""
        return self.root if under(folder, self.root) else folder

    def required(self) -> list[Path]:
        return [self.base / "config.json", self.index, self.vae, self.wav2vec / "config.json", self.lora]


def locate(path: str | Path, *, lora: str | Path | None = None, wav2vec: str | Path | None = None) -> LiveAvatarFolder:
    """The folder of a download from ROOT, ROOT/Wan2.2-S2V-14B or ROOT/LiveAvatar (the files are
    not checked: a missing one is named by `parse_name`, the check or the loader)."""
    p = Path(path)
    if (p / BASE_DIR).is_dir() or (p / LORA_DIR).is_dir():
        base = p / BASE_DIR
    elif (p / LORA_FILE).is_file() and not (p / "config.json").is_file():
        base = p.parent / BASE_DIR  # pointed at LiveAvatar/
    else:
        base = p  # pointed at Wan2.2-S2V-14B/ (or a folder of another name holding it)
    lora_p = Path(lora) if lora else next(
        (c for c in (base.parent / LORA_DIR / LORA_FILE, base / LORA_FILE) if c.is_file()),
        base.parent / LORA_DIR / LORA_FILE)
    w2v = Path(wav2vec) if wav2vec else base / W2V_DIR
    return LiveAvatarFolder(base, lora_p, w2v)


def is_download(path: Path) -> bool:
    """Whether `path` looks like a LiveAvatar download (ROOT or one of its two folders)."""
    if (path / BASE_DIR).is_dir() or (path / LORA_DIR / LORA_FILE).is_file() or path.name == LORA_DIR:
        return True
    try:
        return read_json(path / "config.json").get("_class_name") == CLASS_NAME
    except Bad:
        return False


def parse_name(name: str) -> LiveAvatarFolder | None:
    """`liveavatar:DIR[,lora=PATH][,wav2vec=PATH]` -> the folder (its files checked); None: not such a name."""
    if not name.startswith(PREFIX):
        return None
    root, *opts = name[len(PREFIX):].split(",")
    kw: dict[str, str] = {}
    for opt in opts:
        key, eq, value = opt.partition("=")
        if not eq or key not in ("lora", "wav2vec") or not value:
            raise ConfigError(f"{name!r}: unknown option {opt!r}; use liveavatar:DIR[,lora=PATH][,wav2vec=PATH]")
        kw[key] = value
    folder = locate(root, **kw)
    missing = [str(p) for p in folder.required() if not p.is_file()]
    if missing:
        raise InputError(f"{root}: not a LiveAvatar download ({missing[0]} is missing; expected "
                         f"{BASE_DIR}/ from Wan-AI/Wan2.2-S2V-14B and {LORA_DIR}/{LORA_FILE} from "
                         "Quark-Vision/Live-Avatar side by side)")
    return folder


def dit_config(folder: LiveAvatarFolder) -> LiveAvatarConfig:
    """The DiT's config from its config.json (the official constructor's kwargs)."""
    path = folder.base / "config.json"
    raw = read_json(confine(path, folder.trusted(folder.base)))
    if raw.get("_class_name", CLASS_NAME) != CLASS_NAME:
        raise Bad(f"{path}: a {str(raw['_class_name'])[:60]} config, not the {CLASS_NAME} DiT's")
    liveavatar_dit(raw, str(path))
    try:
        return LiveAvatarConfig.from_official(raw)
    except (ValueError, TypeError) as e:
        raise InputError(f"{path}: not a Wan2.2-S2V DiT config ({e})") from None


