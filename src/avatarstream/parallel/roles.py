"""What each pipeline-parallel rank loads: only the networks its stages run.

A rank of the timestep-forcing pipeline (`parallel/tpp.py`) has one of four roles:

    role      runs                                    loads
    denoise   reference sink, its share of the steps  dit, vae, audio, text   (no refiner)
    decode    SR refiner, VAE decode, publishing      refiner, vae, audio, text   (no DiT)
    refine    SR refiner (with `split_decode`)        refiner, vae, audio, text   (no DiT)
    publish   VAE decode (with `split_decode`)        vae, audio, text   (no DiT, no refiner)

Why these and not fewer: every rank runs the same chunk loop, whose Context stage computes the
chunk's audio tokens (the audio encoder) and whose rolling state starts with a VAE conv cache, and
every rank encodes its own copy of the reference (VAE encoder; text tokens), so every rank holds
the VAE, the audio encoder and the text encoder. Against the DiT these are small: our bundled
model's DiT is 45% of its weights and the refiner 40%; a 14B DiT next to a 0.5 GB VAE is 98%.

How: a model of the registry (`ModelSpec` without its own loader) is built network by network,
only the ones kept, each seeded or read from its weights file exactly as `registry.load_model`
does (`init_random_(seed)` is per network, so leaving one out changes no other's weights). A
family with its own loader (`ModelSpec.load`: an official folder) is asked for its parts when its
loader takes a `parts` argument (`load(device, bf16, parts=...)`, the seam for LiveAvatar: it
then never reads the DiT's shards on the decode rank); otherwise it loads everything and this
drops what the rank does not run (peak memory of a full load, once, at start).

A left-out network is a `NotLoaded` stand-in that names itself if anything calls it, and the
ranks without a DiT encode their reference with `RankReference` (the refiner's reference K/V and
the text tokens; the DiT's sink is the denoise ranks' business).
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import replace
from typing import Any

import torch

from avatarstream.engine.config import ModelSet, PipelineConfig
from avatarstream.engine.module import Module, NotLoaded
from avatarstream.engine.session import SessionState
from avatarstream.engine.stages.reference import frame_validity
from avatarstream.errors import InputError
from avatarstream.hardware import bf16_is_fast
from avatarstream.models.audio import AudioEncoder, StreamingAudioFeatures
from avatarstream.models.dit import VideoRefDiT
from avatarstream.models.refiner import SRRefiner
from avatarstream.models.text import TextEncoder
from avatarstream.models.vae import CausalVAE

log = logging.getLogger(__name__)

PARTS = ("dit", "refiner", "vae", "audio", "text")
ROLE_PARTS: dict[str, tuple[str, ...]] = {
    "denoise": ("dit", "vae", "audio", "text"),
    "decode": ("refiner", "vae", "audio", "text"),
    "refine": ("refiner", "vae", "audio", "text"),
    "publish": ("vae", "audio", "text"),
}


def role_of(rank: int, workers: int, split_decode: bool) -> str:
    if rank < workers:
        return "denoise"
    if not split_decode:
        return "decode"
    return "refine" if rank == workers else "publish"


def _network(spec: Any, part: str) -> torch.nn.Module | None:
    """One fresh network of `spec` (None: a direct model's refiner)."""
    if part == "refiner":
        return None if spec.refiner is None else SRRefiner(spec.refiner())
    make = {"dit": lambda: VideoRefDiT(spec.dit()), "vae": lambda: CausalVAE(spec.vae()),
            "audio": lambda: AudioEncoder(spec.audio()), "text": lambda: TextEncoder(spec.text())}
    return make[part]()


def load_parts(name: str, parts: tuple[str, ...], *, device: str = "cpu", role: str = "rank",
               bf16: bool | None = None) -> ModelSet:
    """The ModelSet of model `name` with only `parts` loaded (the others `NotLoaded`; a refiner
    left out is None, what a direct model has, so the reference stage skips it)."""
    from avatarstream.registry import model_spec_for
    from avatarstream.weights.folder import load_weights

    spec = model_spec_for(name)
    if spec.load is not None:
        return _family_parts(spec, parts, device, role, bf16)
    torch.manual_seed(spec.seed)
    nets = {p: _network(spec, p) for p in parts}
    if spec.weights is None:
        for net in nets.values():
            if net is not None:
                net.init_random_(spec.seed)
    else:
        load_weights(spec, nets)
    if bf16 is None:
        bf16 = name != "tiny-random" and bf16_is_fast(device)
    mods: dict[str, Any] = {}
    for p in PARTS:
        net = nets.get(p)
        if net is None:
            mods[p] = None if p == "refiner" else NotLoaded(p, role)
            continue
        ac = torch.bfloat16 if bf16 and p in ("dit", "refiner", "vae") else None
        mods[p] = Module(p, net, device=device, autocast_dtype=ac)
    audio_model = mods["audio"].model  # every role keeps the audio encoder (module docstring)
    return ModelSet(name=name, config=spec.pipeline(),
                    make_audio_stream=lambda: StreamingAudioFeatures(audio_model), **mods)


def _family_parts(spec: Any, parts: tuple[str, ...], device: str, role: str,
                  bf16: bool | None) -> ModelSet:
    if "parts" in inspect.signature(spec.load).parameters:
        return spec.load(device, bf16, parts=parts)
    models = spec.load(device, bf16)
    dropped = {p: (None if p == "refiner" else NotLoaded(p, role))
               for p in PARTS if p not in parts and getattr(models, p) is not None}
    if dropped:
        log.info("%s rank: %s loads every part; dropping %s", role, spec.name, ", ".join(dropped))
    return replace(models, **dropped)


def loaded_parts(models: ModelSet) -> list[str]:
    """The networks a ModelSet really holds."""
    return [p for p in PARTS if isinstance(getattr(models, p), Module)]


class RankReference:
    """The reference of a rank without the DiT: the refiner's reference K/V (at the output
    size, with the frame-validity mask `ReferenceStage` uses) and the text tokens."""

    name = "reference"

    def __init__(self, models: ModelSet, config: PipelineConfig) -> None:
        self.models, self.config = models, config
        self.seconds = 0.0

    def run(self, state: SessionState, frames: torch.Tensor, prompt: str = "",
            scene: torch.Tensor | None = None) -> None:
        """frames `[F, 3, H, W]` uint8 at the output size (scene: unused, the causal strategy
        starts from its sink)."""
        t0 = time.perf_counter()
        m, c = self.models, self.config
        if m.refiner is not None:
            keep = 1 + 4 * ((frames.shape[0] - 1) // 4)  # the VAE's 1 + 4k frames
            video = frames[:keep].permute(1, 0, 2, 3).float() / 127.5 - 1.0  # [3, F, H, W]
            fv = frame_validity(video)  # [F]; latent j > 0 covers frames 4j-3 .. 4j
            valid = torch.cat([fv[:1], fv[1:].reshape(-1, 4).all(dim=1)])  # [R]
            if not bool(valid.any()):
                raise InputError("the reference has no usable frame (all frames are blank); "
                                 "give a video or image that shows the person's face")
            hr_lat, _ = m.vae.call("encode", video[None])  # [1, C, R, H/8, W/8]
            t_pos = torch.full((hr_lat.shape[2],), c.ref_t_position)
            state.refiner_reference = m.refiner.call("encode_reference", hr_lat, valid[None], t_pos)
        if isinstance(m.text, Module):
            state.text, state.text_mask = m.text.call("encode", [prompt])
        self.seconds += time.perf_counter() - t0


def rank_models(name: str, role: str, *, device: str = "cpu") -> ModelSet:
    """The ModelSet a rank of `role` runs: its parts, and `RankReference` where it has no DiT."""
    models = load_parts(name, ROLE_PARTS[role], device=device, role=role)
    if not isinstance(models.dit, Module) and models.reference is None:
        models.reference = RankReference
    return models
