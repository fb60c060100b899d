"""The personality SFT objective of each model family: flow matching of the DiT on cross-scene
pairs, with the inputs its own inference path gives it (engine/stages/*.py).

Every family: a target window from clip B, a reference from clip A of the same person in another
scene (`Footage.pairs`), σ ~ logit-normal(0, 1) (Avatar V §3.1), x_σ = (1 − σ)·x0 + σ·ε, and
the loss MSE(v̂, ε − x0) over the generated latent frames (given ones are clean and excluded).
All draws come from the step's generator, in a fixed order (a resumed run draws the same).

- `ours` (registry models and exported folders): our A2V objective (train/objectives/a2v.py:
  mouth/eye-weighted flow loss, motion stream, reference motion, the engine's chunk modes) on
  the footage encoded by the model's own VAE (`prepare_footage`). A CFG-distilled DiT (its
  pipeline has `guidance_input`) is trained at guidance (1, 1), where its prediction is the
  conditional one flow matching supervises.
- `flashhead` (`flashhead-pro:DIR`, `flashhead-lite:DIR`): a chunk of `chunk` latents (33
  frames for Pro) encoded whole, its first `overlap` latents given (the motion hand-off), the
  reference picture (a frame of clip A) repeated over the chunk and encoded as `y`, the audio
  context of the chunk's trailing 8 s window (wav2vec2), t = 1000·σ.
- `liveavatar` (`liveavatar:DIR`): one block of `block` latents of clip B's stream latents at its
  place in the stream, with a fresh KV ring and the sink prefilled from a frame of clip A (its
  reference and FramePack latents, as the reference stage makes them), the sink distance drawn
  as the official random.randint(4, 30), t = 1000·σ per frame. The adapter is LiveAvatar's own
  LoRA (rank 128, alpha 64, its targets) continued from the release's weights: the file replaces
  liveavatar.safetensors (`liveavatar:DIR,lora=FILE`), which is how the folder loader reads
  an adapter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from avatarstream.errors import ConfigError
from avatarstream.train.objectives.a2v import A2VTask
from avatarstream.train.objectives.base import pick
from avatarstream.train.personality_data import SAMPLE_RATE, Footage, FootageData, prepare_footage, resize_frames
from avatarstream.weights.lora import LIVEAVATAR_LORA, LoRASettings

DEFAULT_TARGETS = ("q", "k", "v", "o", "ffn.0", "ffn.2")


def logit_normal(g: torch.Generator, n: int) -> torch.Tensor:
    """`[n]` σ ~ logit-normal(0, 1)."""
    return torch.sigmoid(torch.randn(n, generator=g))


def flow_loss(v: torch.Tensor, eps: torch.Tensor, x0: torch.Tensor, gen: torch.Tensor) -> torch.Tensor:
    """MSE(v, ε − x0) over the latent frames `gen` (bool `[T]`) of `[B, C, T, h, w]` tensors."""
    err = (v.float() - (eps - x0).float()).square()[:, :, gen]
    return err.mean()


class Family:
    """What the trainer needs of a family: the DiT the adapter is for, the loss of a step."""

    name = ""
    replaces: str | None = None  # the base's own adapter this one stands in for (LiveAvatar's)
    fixed: LoRASettings | None = None  # settings the family's loader imposes
    init_adapter: dict[str, torch.Tensor] | None = None  # starting A/B (None: PEFT's init)
    net: nn.Module

    def loss(self, g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def load_hint(self, base: str, out: Path) -> str:
        return f"--model {base} --lora {out}"


# -- ours ------------------------------------------------------------------------------------------
class _PersonalityA2V(A2VTask):
    """A2VTask on a footage file with the loaded model's networks (not the preset's fresh ones)."""

    def __init__(self, recipe: dict[str, Any], device: torch.device, footage: Footage,
                 nets: dict[str, nn.Module], guidance: bool) -> None:
        super().__init__(recipe, device)
        self.data = FootageData(recipe["data"]["prepared"], footage)
        if self.direct:
            self.data.use_hr_as_lr()
        self.clip_ids = self.data.usable(self.T)
        if not self.clip_ids:
            raise ConfigError(f"no paired target clip of {footage.root} has {self.T} latent frames "
                              f"({4 * self.T - 3} video frames)")
        self.nets = nets
        self.guidance = guidance

    def predict(self, dit, b, *, audio=True, ref=True, guidance=None):  # type: ignore[no-untyped-def,override]
        if guidance is None and self.guidance:  # a CFG-distilled DiT at (1, 1): the conditional prediction
            guidance = torch.ones(b["xs"].shape[0], 2, device=self.device)
        return super().predict(dit, b, audio=audio, ref=ref, guidance=guidance)


class Ours(Family):
    name = "ours"

    def __init__(self, base: str, footage: Footage, work: Path, *, batch: int, seed: int, device: str) -> None:
        from avatarstream.registry import load_model
        from avatarstream.train.nets import GEOMETRY
        from avatarstream.train.recipe import resolve

        models = load_model(base, device=device, bf16=False)
        cfg = models.config
        preset = next((k for k, g in GEOMETRY.items() if g["hr_size"] == cfg.hr_size), None)
        if preset is None:
            sizes = ", ".join(f"{k} ({g['hr_size']} px)" for k, g in GEOMETRY.items())
            raise ConfigError(f"--base {base}: {cfg.hr_size} px output; our presets are {sizes}")
        direct = cfg.lr_size == cfg.hr_size
        prepared = work / "footage.prepared.safetensors"
        if not prepared.is_file():  # encoded once per run folder (deterministic: a resume re-reads it)
            prepare_footage(footage, models.vae.model, prepared, lr_size=GEOMETRY[preset]["lr_size"],
                            hr_size=cfg.hr_size, device=device)
            footage.forget()
        from avatarstream.train.data import PreparedData

        measured = bool(PreparedData(prepared).meta.get("measured_motion"))
        guided = bool(cfg.guidance_input)
        recipe = resolve({"stage": "a2v", "model": preset, "train": {"batch": batch, "seed": seed},
                          "data": {"prepared": str(prepared)},
                          "a2v": {"chunk": cfg.chunk, "ref_frames": cfg.ref_frames, "p_cross_scene": 1.0,
                                  "direct": direct, "train_audio": False, "train_text": False,
                                  "motion": 0.5 if measured else 0.0, "ref_motion": 0.1 if measured else 0.0,
                                  "p_drop_audio": 0.0 if guided else 0.1, "p_drop_ref": 0.0 if guided else 0.05,
                                  "audio_window": cfg.audio_window, "ref_t_position": cfg.ref_t_position}},
                         name="personality")
        nets = {k: getattr(models, k).model for k in ("dit", "audio", "text")}
        self.task = _PersonalityA2V(recipe, torch.device(device), footage, nets, guided)
        self.net = nets["dit"]
        self.info = {"preset": preset, "direct": direct, "measured_motion": measured, "guidance": guided}

    def loss(self, g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        return self.task.loss(g)


# -- FlashHead -------------------------------------------------------------------------------------
def _pick_frame(footage: Footage, i: int, g: torch.Generator) -> np.ndarray:
    frames = footage.frames(i)
    return frames[pick(g, frames.shape[0]):][:1]


class FlashHead(Family):
    name = "flashhead"

    def __init__(self, base: str, footage: Footage, *, batch: int, device: str) -> None:
        from avatarstream.engine.stages.flashhead import frames_per_chunk
        from avatarstream.models.wav2vec2.flashhead import FlashHeadAudioConfig
        from avatarstream.registry import load_model

        m = load_model(base, device=device, bf16=False)
        self.c = c = m.config
        self.net, self.vae, self.w2v = m.dit.model, m.vae.model, m.audio.model
        self.frames = frames_per_chunk(c)
        self.audio_cfg = FlashHeadAudioConfig(sample_rate=c.sample_rate, fps=c.fps, frame_num=self.frames)
        self.footage, self.batch, self.device = footage, batch, torch.device(device)
        self.hw = c.out_hw
        self.targets = [t for t in footage.targets() if footage.frames(t).shape[0] >= self.frames]
        if not self.targets:
            raise ConfigError(f"no paired target clip of {footage.root} has a chunk's {self.frames} frames")
        self.info = {"chunk_frames": self.frames, "given_latents": c.overlap}

    @torch.no_grad()
    def _encode(self, video: torch.Tensor) -> torch.Tensor:
        out = self.vae.encode(video.to(self.device))
        return (out[0] if isinstance(out, tuple) else out).float()

    @torch.no_grad()
    def _audio(self, wave: np.ndarray, end_frame: int) -> torch.Tensor:
        """The chunk's audio context: the trailing window ending at `end_frame`, as the stream has it."""
        from avatarstream.models.wav2vec2.flashhead import flashhead_audio_context

        cfg = self.audio_cfg
        stop = end_frame * SAMPLE_RATE // self.c.fps
        window = torch.zeros(cfg.window_samples)
        w = torch.from_numpy(wave[max(0, stop - cfg.window_samples):stop])
        window[cfg.window_samples - w.shape[0]:] = w
        end = cfg.frames(cfg.window_samples)
        return flashhead_audio_context(self.w2v, window.to(self.device), cfg, end - cfg.frame_num, end).float()

    def loss(self, g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        fp, h, losses = self.footage, self.c.overlap, []
        for _ in range(self.batch):
            t = self.targets[pick(g, len(self.targets))]
            refs = fp.references_of(t)
            r = refs[pick(g, len(refs))]
            a = pick(g, fp.frames(t).shape[0] - self.frames + 1)
            x0 = self._encode(resize_frames(fp.frames(t)[a:a + self.frames], *self.hw)[None])
            pic = resize_frames(_pick_frame(fp, r, g), *self.hw)[None]
            y = self._encode(pic.expand(-1, -1, self.frames, -1, -1).contiguous())
            audio = self._audio(fp.wave(t), a + self.frames)
            sigma = logit_normal(g, 1)
            eps = torch.randn(x0.shape, generator=g).to(self.device)
            xs = (1 - sigma) * x0 + sigma * eps
            xs[:, :, :h] = x0[:, :, :h]  # the hand-off latents, written before every step
            v = self.net(xs, sigma.to(self.device), audio, y)
            gen = torch.ones(x0.shape[2], dtype=torch.bool)
            gen[:h] = False
            losses.append(flow_loss(v, eps, x0, gen))
        loss = torch.stack(losses).mean()
        return loss, {"loss": float(loss.detach()), "flow": float(loss.detach())}


# -- LiveAvatar ------------------------------------------------------------------------------------
class LiveAvatar(Family):
    name = "liveavatar"
    replaces = "liveavatar.safetensors (the LiveAvatar LoRA)"
    fixed = LIVEAVATAR_LORA

    def __init__(self, base: str, footage: Footage, *, batch: int, device: str) -> None:
        from avatarstream.models.wav2vec2.liveavatar_stream import LiveAvatarStreamConfig
        from avatarstream.weights.liveavatar_folder import load_liveavatar_dit, parse_name
        from avatarstream.weights.liveavatar_model import load_liveavatar, split_name
        from avatarstream.weights.official import read_state

        rest, context, _ = split_name(base)
        folder = parse_name(rest)
        assert folder is not None
        m = load_liveavatar(folder, base, context, device=device, bf16=False, parts=("vae", "audio"))
        self.c = c = m.config
        self.net = load_liveavatar_dit(folder, dtype=torch.float32, device=device, lora=False)
        self.init_adapter = {k: v.float() for k, v in read_state(folder.lora).items()}
        self.vae, self.w2v = m.vae.model, m.audio.model
        with torch.no_grad():
            self.context = m.text.model.encode([""]).float()
        self.audio_cfg = LiveAvatarStreamConfig(sample_rate=c.sample_rate, fps=c.fps,
                                                lookahead_frames=c.audio_window - 3)
        self.footage, self.batch, self.device, self.hw = footage, batch, torch.device(device), c.out_hw
        self.block = c.block
        self._latents: dict[int, torch.Tensor] = {}
        self.targets = [t for t in footage.targets() if self._blocks(t) > 0]
        if not self.targets:
            raise ConfigError(f"no paired target clip of {footage.root} is one block "
                              f"({4 * self.block} frames) long")
        self.info = {"block": self.block, "continues": str(folder.lora)}

    def load_hint(self, base: str, out: Path) -> str:
        rest = ",".join(p for p in base.split(",") if not p.startswith("lora="))
        return f"--model {rest},lora={out}"

    def _blocks(self, t: int) -> int:
        n = self.footage.frames(t).shape[0]
        return (n - 1) // (4 * self.block) if n > 4 * self.block else 0

    @torch.no_grad()
    def _encode(self, video: torch.Tensor) -> torch.Tensor:
        out = self.vae.encode(video.to(self.device))
        return (out[0] if isinstance(out, tuple) else out).float()

    def _stream_latents(self, t: int) -> torch.Tensor:
        """Clip t's latents as the stream encodes it, whole (1 + 4k frames), cached."""
        if t not in self._latents:
            frames = self.footage.frames(t)
            k = 1 + 4 * ((frames.shape[0] - 1) // 4)
            self._latents[t] = self._encode(resize_frames(frames[:k], *self.hw)[None])
        return self._latents[t]

    @torch.no_grad()
    def _audio(self, wave: np.ndarray, a: int, b: int) -> torch.Tensor:
        from avatarstream.models.wav2vec2.liveavatar_stream import LiveAvatarAudioStream

        stream = LiveAvatarAudioStream(self.w2v, self.audio_cfg)
        stop = (b + self.audio_cfg.lookahead_frames) * SAMPLE_RATE // self.c.fps
        w = np.zeros(stop, np.float32)
        src = wave[:stop]
        w[: src.shape[0]] = src
        stream.push(torch.from_numpy(w))
        return stream.block(a, b).float()

    def loss(self, g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        from avatarstream.engine.liveavatar import SINK_DISTANCE_RANGE
        from avatarstream.models.liveavatar.ring import KVRing

        fp, f, losses = self.footage, self.block, []
        for _ in range(self.batch):
            t = self.targets[pick(g, len(self.targets))]
            refs = fp.references_of(t)
            r = refs[pick(g, len(refs))]
            j = pick(g, self._blocks(t))
            x0 = self._stream_latents(t)[:, :, f * j:f * j + f]
            pic = resize_frames(_pick_frame(fp, r, g), *self.hw)[None]
            ref = self._encode(pic)
            motion = self._encode(pic.expand(-1, -1, self.net.config.motion_frames, -1, -1).contiguous())
            lo, hi = SINK_DISTANCE_RANGE
            d = lo + pick(g, hi - lo + 1)
            audio = self._audio(fp.wave(t), 4 * f * j, 4 * f * (j + 1))
            sigma = logit_normal(g, 1)
            eps = torch.randn(x0.shape, generator=g).to(self.device)
            xs = (1 - sigma) * x0 + sigma * eps
            sink = self.net.prefill_sink(ref, motion, self.context)
            ring = KVRing(len(self.net.blocks), f * self.c.kv_blocks)
            tt = (1000.0 * sigma).expand(1, x0.shape[2]).to(self.device)
            v = self.net.forward_block(xs, tt, audio, self.context, sink, ring, f * j, d)
            losses.append(flow_loss(v, eps, x0, torch.ones(x0.shape[2], dtype=torch.bool)))
        loss = torch.stack(losses).mean()
        return loss, {"loss": float(loss.detach()), "flow": float(loss.detach())}


def make_family(base: str, footage: Footage, work: Path, *, batch: int, seed: int, device: str) -> Family:
    """The family of `--base`: `flashhead-*:DIR`, `liveavatar:DIR`, else one of ours."""
    if base.startswith("flashhead-"):
        return FlashHead(base, footage, batch=batch, device=device)
    if base.startswith("liveavatar:"):
        return LiveAvatar(base, footage, batch=batch, device=device)
    return Ours(base, footage, work, batch=batch, seed=seed, device=device)


