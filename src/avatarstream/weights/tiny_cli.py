"""`avatarstream models tiny FAMILY DIR`: a tiny random folder in an official layout, to try
`models check` and the real-model paths (`generate --model flashhead-pro:DIR`, `liveavatar:DIR`)
in seconds, without a download. The weights are random (the video is noise that moves with the
audio); the files, names, configs and formats are the release's, at a width of 64.

The writers are the ones the tests use (`write_official_folder` of weights/flashhead_folder.py and
weights/liveavatar_folder.py, `write_wav2vec2_folder`); this module only parses and reports, and
imports them when it runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from avatarstream.errors import OutputError

FAMILIES = {
    "flashhead-pro": "SoulX-FlashHead-1_3B layout: Model_Pro/, VAE_Wan/, wav2vec2-base-960h/",
    "flashhead-lite": "SoulX-FlashHead-1_3B layout: Model_Lite/, VAE_LTX/, wav2vec2-base-960h/",
    "liveavatar": "Wan2.2-S2V-14B/ (sharded DiT, Wan VAE, wav2vec2) + LiveAvatar/liveavatar.safetensors",
    "wav2vec2": "a Hugging Face wav2vec2 folder (config.json, model.safetensors)",
}
# what each family writes in DIR: a folder already holding one of these is not written over
WRITES = {"flashhead-pro": ("Model_Pro", "VAE_Wan"), "flashhead-lite": ("Model_Lite", "VAE_LTX"),
          "liveavatar": ("Wan2.2-S2V-14B", "LiveAvatar"), "wav2vec2": ("config.json", "model.safetensors")}


def add_arguments(sub: argparse._SubParsersAction) -> None:
    """Register `tiny` under `avatarstream models`."""
    p = sub.add_parser("tiny", help="write a tiny random folder in an official layout (flashhead-pro, "
                       "flashhead-lite, liveavatar, wav2vec2) to try `models check` and --model without a download",
                       description="; ".join(f"{k}: {v}" for k, v in FAMILIES.items()))
    p.add_argument("family", choices=list(FAMILIES), help="which layout")
    p.add_argument("folder", help="where to write it (new or empty; a tiny FlashHead folder takes the other variant)")
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed (default 0)")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.set_defaults(func=run)


def _refuse_existing(family: str, root: Path) -> None:
    if root.exists() and not root.is_dir():
        raise OutputError(f"{root}: exists and is not a folder; give a new or empty folder")
    there = [w for w in WRITES[family] if (root / w).exists()]
    flashhead_tiny = family.startswith("flashhead") and (root / "avatarstream.json").is_file()
    if there or (root.is_dir() and any(root.iterdir()) and not flashhead_tiny):
        raise OutputError(f"{root}: not empty ({(there or [next(root.iterdir()).name])[0]} is there); give a new "
                          "or empty folder (nothing is written over)")


def write(family: str, root: Path, seed: int = 0) -> dict[str, Any]:
    """Write the folder; the report: where, which family, the files, what to run next."""
    import torch

    _refuse_existing(family, root)
    root.mkdir(parents=True, exist_ok=True)
    if family.startswith("flashhead"):
        from avatarstream.weights.flashhead_folder import write_official_folder

        write_official_folder(root, family.split("-")[1], seed=seed)
        model = f"{family}:{root}"
    elif family == "liveavatar":
        from avatarstream.weights.liveavatar_folder import write_official_folder as write_liveavatar

        write_liveavatar(root, seed=seed)
        model = f"liveavatar:{root}"
    else:
        from avatarstream.models.wav2vec2 import Wav2Vec2Config
        from avatarstream.weights.liveavatar_folder import write_wav2vec2_folder

        write_wav2vec2_folder(root, Wav2Vec2Config.tiny(), torch.Generator().manual_seed(seed))
        model = None
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    try_ = [f"avatarstream models check {root}"]
    if model is not None:
        try_.append(f"avatarstream generate --model {model} --reference examples/reference.png "
                    "--audio examples/speech.mp3 --out tiny.mp4")
    return {"folder": str(root), "family": family, "files": files, "random_weights": True, "try": try_}


def run(args: argparse.Namespace) -> int:
    report = write(args.family, Path(args.folder), args.seed)
    if not args.json:
        print(f"wrote a tiny random {args.family} folder ({len(report['files'])} files, random weights) "
              f"at {report['folder']}; try:")
        for line in report["try"]:
            print(f"  {line}")
    print(json.dumps(report))
    return 0
