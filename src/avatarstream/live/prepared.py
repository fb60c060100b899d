"""PreparedReference: an avatar's reference, encoded once for one model and kept on disk.

What the engine's ReferenceStage computes at the start of every request (VAE latents at both
resolutions -> the DiT's and the SR refiner's per-layer reference K/V, with the validity mask) is
computed here once per (avatar, model) and saved as one safetensors file; every later session of
that avatar, in this process or after a restart, loads it instead of encoding again. The text
tokens of the prompt are cheap and model-global, so they are not part of it.

File layout (tensor names): `{dit,refiner}.k.{layer}`, `{dit,refiner}.v.{layer}`,
`{dit,refiner}.motion`, `{dit,refiner}.t_pos`, optionally `{dit,refiner}.key_valid`, and the scene
frame `scene.lr` [1, C, h, w] / `scene.motion` [1, Dm] (format 2); the metadata holds the model
name, the layer count and the tokens per frame. A model family with a reference record of its own
(FlashHead: `y` and the colour reference; LiveAvatar: its reference and motion latents and prompt
context) stores it as `family.*` with metadata `family`. A file of an older format is not loaded (the
avatar store encodes the reference again).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from avatarstream.cache.reference import ReferenceCache
from avatarstream.engine.config import ModelSet, PipelineConfig
from avatarstream.engine.pipeline import reference_stage
from avatarstream.engine.session import SessionState
from avatarstream.engine.stages.flashhead import FlashHeadReference
from avatarstream.engine.stages.liveavatar import LiveAvatarReference
from avatarstream.errors import InputError

# model families with a reference record of their own (`tensors()` / `from_tensors`), by file tag
FAMILY_REFERENCES = {"flashhead": FlashHeadReference, "liveavatar": LiveAvatarReference}

FORMAT = "avatarstream-prepared-reference-2"


@dataclass
class PreparedReference:
    model: str
    dit: ReferenceCache
    refiner: ReferenceCache | None  # None: a direct model (no refiner)
    scene_lr: torch.Tensor  # [1, C, h, w] the scene frame (ReferenceStage)
    scene_motion: torch.Tensor  # [1, Dm]

    def apply(self, state: SessionState) -> None:
        """Put the prepared caches and scene frame into a new session's rolling state."""
        state.dit_reference, state.refiner_reference = self.dit, self.refiner
        state.store.set_scene(self.scene_lr, self.scene_motion)

    def check_geometry(self, config: PipelineConfig) -> None:
        """An InputError when this avatar was prepared for another video size than `config`
        renders (its scene latent `[1, C, h, w]` is not `config.latent_hw`): an avatar stored by
        a server started with another `--size`."""
        got = tuple(self.scene_lr.shape[-2:])
        if got != config.latent_hw:
            s = config.spatial_stride * config.hr_size // config.lr_size  # output pixels per latent
            h, w = config.out_hw
            raise InputError(f"this avatar was prepared for a {got[1] * s}x{got[0] * s} video and the "
                             f"model renders {w}x{h} (width x height); upload the avatar again")

    def nbytes(self) -> int:
        return (self.dit.nbytes() + (0 if self.refiner is None else self.refiner.nbytes())
                + self.scene_lr.numel() * 4
                + self.scene_motion.numel() * 4)


def prepare_reference(models: ModelSet, frames: torch.Tensor) -> PreparedReference:
    """Encode reference frames [F, 3, H, W] uint8 (at the model's `config.out_hw`) once: the
    ReferenceStage's work.

    Raises InputError when no frame is usable (blank reference) or the frames are of another size."""
    state = SessionState()
    with torch.inference_mode():
        reference_stage(models, models.config).run(state, frames, "")
    scene = state.store.scene()
    assert scene is not None  # ReferenceStage always sets it
    return PreparedReference(models.name, state.dit_reference, state.refiner_reference, *scene)


def _flatten(prefix: str, cache: ReferenceCache, out: dict[str, torch.Tensor]) -> None:
    for i, (k, v) in enumerate(zip(cache.k, cache.v)):
        out[f"{prefix}.k.{i}"] = k.clone(memory_format=torch.contiguous_format)
        out[f"{prefix}.v.{i}"] = v.clone(memory_format=torch.contiguous_format)
    out[f"{prefix}.motion"] = cache.motion.clone(memory_format=torch.contiguous_format)
    out[f"{prefix}.t_pos"] = cache.t_pos.clone()
    if cache.key_valid is not None:
        out[f"{prefix}.key_valid"] = cache.key_valid.to(torch.uint8).contiguous()


def _unflatten(prefix: str, tensors: dict[str, torch.Tensor], layers: int,
               tokens_per_frame: int) -> ReferenceCache:
    kv = tensors.get(f"{prefix}.key_valid")
    return ReferenceCache(
        k=[tensors[f"{prefix}.k.{i}"] for i in range(layers)],
        v=[tensors[f"{prefix}.v.{i}"] for i in range(layers)],
        motion=tensors[f"{prefix}.motion"],
        t_pos=tensors[f"{prefix}.t_pos"],
        tokens_per_frame=tokens_per_frame,
        key_valid=None if kv is None else kv.to(torch.bool),
    )


def save_prepared(ref: PreparedReference, path: str | Path) -> None:
    """Write atomically (a temporary file renamed into place): a crash leaves no half file."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    family = next((tag for tag, cls in FAMILY_REFERENCES.items() if isinstance(ref.dit, cls)), None)
    if family is not None:  # a model family's own reference record
        tensors.update({f"family.{k}": v for k, v in ref.dit.tensors().items()})
        meta = {"format": FORMAT, "model": ref.model, "family": family}
    else:
        _flatten("dit", ref.dit, tensors)
        meta = {"format": FORMAT, "model": ref.model,
                "dit_layers": str(len(ref.dit.k)), "dit_tokens": str(ref.dit.tokens_per_frame)}
    if ref.refiner is not None:
        _flatten("refiner", ref.refiner, tensors)
    tensors["scene.lr"] = ref.scene_lr.float().contiguous()
    tensors["scene.motion"] = ref.scene_motion.float().contiguous()
    if ref.refiner is not None:
        meta.update(refiner_layers=str(len(ref.refiner.k)), refiner_tokens=str(ref.refiner.tokens_per_frame))
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)


def load_prepared(path: str | Path) -> PreparedReference:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a prepared reference ({meta.get('format')!r})")
    t = load_file(str(path))
    family = FAMILY_REFERENCES.get(meta.get("family", ""))
    dit = (family.from_tensors({k[7:]: v for k, v in t.items() if k.startswith("family.")})
           if family is not None
           else _unflatten("dit", t, int(meta["dit_layers"]), int(meta["dit_tokens"])))
    return PreparedReference(
        meta["model"],
        dit,
        (_unflatten("refiner", t, int(meta["refiner_layers"]), int(meta["refiner_tokens"]))
         if "refiner_layers" in meta else None),
        t["scene.lr"], t["scene.motion"],
    )
