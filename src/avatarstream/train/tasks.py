"""Stage objectives. A task builds its networks, samples a batch for a step from a
`torch.Generator` seeded by (seed, step) (so a resumed run draws the same data and noise), and
returns the loss. Batches are drawn on the CPU and moved to the device: the same recipe gives
the same batches on any device.

Inference contract the tasks follow (engine/stages/*.py):
- DiT: latents `[B, C, T, h, w]` at LR, per-frame `sigma [B, T]`, given frames clean with σ = 0,
  motion tokens `[B, T, Dm]` noised with the same σ as their frame, audio tokens
  `[B, T, 4 + 2w, Da]` (`group_per_latent` of the AudioEncoder's per-frame features over the
  clip's timeline positions, zero-extended signal), text tokens of the prompt, chunk RoPE
  positions `arange(T)`, reference = LR latents of the first frames of a reference clip at
  RoPE position −8 (`ref_t_position`) with a validity mask.
- Refiner: `x = (1 − σ) up + σ ε` with `up = upsample2x(lr)`, `x0 = x − σ v`, σ = 0.6, HR
  reference latents, clean motion tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from avatarstream.models.audio import AudioConfig, AudioEncoder, group_per_latent, latent_frame_range
from avatarstream.models.dit import DiTCondition, DiTConfig, VideoRefDiT
from avatarstream.models.refiner import RefinerConfig, SRRefiner, upsample2x
from avatarstream.models.text import TextConfig, TextEncoder
from avatarstream.models.vae import CausalVAE, VAEConfig
from avatarstream.errors import ConfigError
from avatarstream.train.data import (FRAME_KEYS, PixelClip, PreparedData, load_pixel_clips,
                                     motion_descriptor, region_weight)

NETS = ("dit", "refiner", "vae", "audio", "text")
X0_LOSS_FLOOR = 0.25
GEOMETRY = {"tiny": {"lr_size": 32, "hr_size": 64}, "small": {"lr_size": 128, "hr_size": 256}}


def x0_floor_weight(sigma: torch.Tensor, x0_skip: bool) -> torch.Tensor:
    """Per-frame loss weight `[B, 1, T, 1, 1]` of a velocity error at sigma `[B, T]`: an `x0_skip`
    DiT's velocity error is its x̂0 error / σ, so below σ = X0_LOSS_FLOOR the weight is
    (σ / floor)² and the loss there is the x̂0 error / floor², bounded instead of growing as
    1/σ² (the samplers query σ ≥ 0.25 at 4 steps). Any other DiT: 1."""
    s = sigma.float()
    w = (s / s.clamp_min(X0_LOSS_FLOOR)) ** 2 if x0_skip else torch.ones_like(s)
    return w[:, None, :, None, None]


def dit_config(model: str, direct: bool = False) -> DiTConfig:
    """The preset's DiT config; `direct`: it generates at the output (HR) resolution with 2× the
    spatial patch, so a frame has as many tokens as at LR (no SR refiner in the chain)."""
    cfg = getattr(DiTConfig, model)()
    if direct:
        cfg = dataclasses.replace(cfg, patch=(1, 2 * cfg.patch[1], 2 * cfg.patch[2]), x0_skip=True)
    return cfg


def build_nets(model: str, direct: bool = False) -> dict[str, nn.Module]:
    """All five networks at the preset's sizes (fresh, default PyTorch init); `direct`: see
    `dit_config`."""
    pick = lambda cls: getattr(cls, model)()  # noqa: E731
    return {"dit": VideoRefDiT(dit_config(model, direct)), "refiner": SRRefiner(pick(RefinerConfig)),
            "vae": CausalVAE(pick(VAEConfig)), "audio": AudioEncoder(pick(AudioConfig)),
            "text": TextEncoder(pick(TextConfig))}


def vae_for(model: str, state: dict[str, torch.Tensor]) -> CausalVAE:
    """The preset's VAE in the variant `state` was trained as: weights from before the
    parameter-free shortcuts (no `decoder.head.skip`) get `shortcuts = False`, so a trained
    latent space stays usable when the preset moves on. Loads `state` strictly."""
    cfg = getattr(VAEConfig, model)()
    if cfg.shortcuts and not any(k.startswith("decoder.head.skip.") for k in state):
        cfg = dataclasses.replace(cfg, shortcuts=False)
    vae = CausalVAE(cfg)
    vae.load_state_dict(state)
    return vae


def init_net(name: str, net: nn.Module, seed: int) -> None:
    """Starting weights of a trained-from-scratch network.

    Transformers: the registry's `init_random_` (fan-in scaled, no zero heads) with the output
    heads, AdaLN gates and the motion head scaled down ×0.1 (small initial updates keep the
    residual stream stable). VAE with shortcuts: `init_pooling_` (the average-pooling
    autoencoder). Other VAEs / encoders: their `init_random_`.
    """
    if name == "vae" and net.cfg.shortcuts:
        net.init_pooling_(seed)  # starts as the average-pooling autoencoder (see CausalVAE)
    else:
        net.init_random_(seed)
    if name in ("dit", "refiner"):
        with torch.no_grad():
            for n, p in net.named_parameters():
                if n.startswith("head.") or n.startswith("motion_head.") or n.endswith("o.weight"):
                    p.mul_(0.1)
                if n.startswith("guidance_embedding.2."):  # neutral until CFG distillation trains it
                    p.zero_()


def _pick(g: torch.Generator, n: int) -> int:
    return int(torch.randint(n, (1,), generator=g))


def _rand(g: torch.Generator) -> float:
    return float(torch.rand((), generator=g))


def _latent_points(table: torch.Tensor, positions: list[int], scale: float) -> torch.Tensor:
    """Mouth/eye points `[T, 6]` of latent frames (mean over their video frames), × scale."""
    cols = [FRAME_KEYS.index(k) for k in ("mouth_x", "mouth_y", "eye_rx", "eye_ry", "eye_lx", "eye_ly")]
    f = table.shape[0]
    out = []
    for p in positions:
        a, b = (0, 1) if p == 0 else (4 * p - 3, 4 * p + 1)
        a, b = min(a, f - 1), min(max(b, a + 1), f)
        out.append(table[a:b, cols].mean(0))
    return torch.stack(out) * scale


class Task:
    """Base: `nets` (every network the stage uses), `trainable` (names it updates)."""

    stage = ""
    trainable: tuple[str, ...] = ()

    def __init__(self, recipe: dict[str, Any], device: torch.device) -> None:
        self.recipe, self.device = recipe, device
        self.cfg = recipe[self.stage]
        self.direct = bool(self.cfg.get("direct", False))
        self.geometry = dict(GEOMETRY[recipe["model"]])
        if self.direct:  # the DiT works on the output-resolution latents
            self.geometry["lr_size"] = self.geometry["hr_size"]
        all_nets = build_nets(recipe["model"], self.direct)
        self.nets = {k: all_nets[k] for k in self.uses()}
        for i, (k, net) in enumerate(sorted(self.nets.items())):
            init_net(k, net, recipe["train"]["seed"] * 101 + i)

    def uses(self) -> tuple[str, ...]:
        return self.trainable

    def after_init(self) -> None:
        """Called by the trainer after `[init]` weights are loaded (before any checkpoint)."""

    def freeze(self) -> None:
        """Called by the trainer after it set requires_grad on the trainable nets: a task may
        freeze parts of them (their parameters then get no optimizer state)."""

    def loss(self, g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def randn(self, g: torch.Generator, *shape: int) -> torch.Tensor:
        """Standard normal noise drawn on the CPU from the step's generator, on the device."""
        return torch.randn(*shape, generator=g).to(self.device)


# ---------------------------------------------------------------------------------------------
class VAETask(Task):
    """Causal VAE: weighted L1 + spatial-gradient L1 + multi-scale L1 + temporal-difference L1 +
    KL. Samples: `1 + 4(latent_frames − 1)` consecutive frames of a clip, at HR or (p_lr)
    area-downsampled to LR, random `crop`² crop. The L1 terms are weighted by
    `1 + mouth·g(mouth) + eyes·g(eyes)` (Gaussians of std `radius` × frame size around the
    annotated mouth centre and the projected eye centres) so mouths and eyes get sharp; the
    temporal term too, so the mouth's frame-to-frame motion inside a latent frame's 4 frames
    counts. `mouth_temporal` weighs the squared error of the frame-to-frame change inside the
    mouth's Gaussian alone (the Sync-C of the round trip depends on it). With probability
    `p_mouth_crop` the crop is placed around the mouth. `latent_noise` > 0 adds Gaussian noise of
    a per-sample std drawn from [0, latent_noise] × the latents' std to the trained window's
    latents, the target still the clean frames: the decoder learns to map latents near the
    encoder's (a DiT's few-step prediction) to a plausible picture rather than to artefacts.
    `predicted` (a file of `avatarstream train predict`: a DiT's own teacher-forced predictions
    of the clips' latents) goes further: with probability `p_predicted` a batch decodes those
    latents instead of the encoder's, the target still the clip's frames, so the decoder learns
    what the DiT actually hands it (a decoder fine-tune: `train_encoder = false`). Such a batch
    is at HR, its windows and crops on latent-frame and latent-pixel boundaries, without KL.

    **Warm caches** (`warm_latents` > 0): the causal VAE's temporal receptive field is about 15
    latent frames (60 video frames) for both presets, and a stream decoded chunk by chunk spends
    almost all its time past the zero padding at its start. A VAE trained only on short windows
    from a stream's start learns to lean on that padding and falls apart in the steady state
    (measured: 20 dB on the first 9 frames, 8 dB from frame 16 on). So, except with probability
    `p_stream_start`, a sample is `warm_latents` latent frames of context streamed through
    `encode_step` / `decode_step` without gradients (filling the conv caches), then the trained
    window of `latent_frames` latent frames (4 video frames each) continues the same stream."""

    stage = "vae"
    trainable = ("vae",)

    def freeze(self) -> None:
        """`train_encoder = false` (decoder fine-tuning): the encoder and quant_conv are frozen,
        so the latent space, every prepared file and every DiT trained on it stay valid while
        the decoder improves (start from a weights folder with `init.vae`)."""
        if not self.cfg["train_encoder"]:
            vae = self.nets["vae"]
            vae.encoder.requires_grad_(False)
            vae.quant_conv.requires_grad_(False)

    def __init__(self, recipe: dict[str, Any], device: torch.device) -> None:
        super().__init__(recipe, device)
        d = recipe["data"]
        if not d["shards"]:
            raise ConfigError("the vae recipe needs data.shards (a folder made by `avatarstream synth`)")
        self.clips: list[PixelClip] = load_pixel_clips(d["shards"], d["max_clips"] or None)
        self.n_frames = 1 + 4 * (self.cfg["latent_frames"] - 1)
        warm = self.cfg["warm_latents"]
        # with warm-up: 1 + 4(warm − 1) context frames, then 4 · latent_frames trained frames
        self.n_warm_frames = 1 + 4 * (warm - 1) if warm > 0 else 0
        need = self.n_warm_frames + 4 * self.cfg["latent_frames"] if warm > 0 else self.n_frames
        self.clips = [c for c in self.clips if c.frames.shape[0] >= need]
        if not self.clips:
            raise ConfigError(f"no clip has {self.n_frames} frames (vae.latent_frames too large)")
        self.pred = None
        if self.cfg["predicted"]:
            from avatarstream.train.predicted import PredictedLatents

            if self.cfg["train_encoder"]:
                raise ConfigError("vae.predicted fine-tunes the decoder alone: set vae.train_encoder = false")
            self.pred = PredictedLatents(self.cfg["predicted"])
            L, W = self.cfg["latent_frames"], warm
            self.pred_clips = [c for c in self.clips if c.key in self.pred.by_key
                               and self.pred.by_key[c.key]["latents"] >= L + W
                               and c.frames.shape[0] >= 1 + 4 * (self.pred.by_key[c.key]["latents"] - 1)]
            if not self.pred_clips:
                raise ConfigError(f"{self.cfg['predicted']}: none of its clips is in {d['shards']} "
                                  f"with {L + W} latent frames")

    def _crop(self, g: torch.Generator, x: torch.Tensor, pts: torch.Tensor, size: int, step: int = 1
              ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """Crop of video `[3, F, S, S]` (`crop`², around the mouth with prob p_mouth_crop, offsets
        multiples of `step`) -> (video, weights `[2, F, c, c]`: loss weight and mouth Gaussian,
        oy, ox)."""
        c = min(self.cfg["crop"], size)
        if c < size and _rand(g) < self.cfg["p_mouth_crop"]:
            # the mouth (its mean position over the window) lands in the crop's central half
            mx, my = (float(v) for v in pts[:, :2].mean(0))
            ox = min(max(int(mx) - c // 4 - _pick(g, c // 2 + 1), 0), size - c)
            oy = min(max(int(my) - c // 4 - _pick(g, c // 2 + 1), 0), size - c)
        else:
            oy, ox = _pick(g, size - c + 1), _pick(g, size - c + 1)
        oy, ox = oy // step * step, ox // step * step
        x = x[:, :, oy:oy + c, ox:ox + c]
        pts = pts.clone()
        pts[:, 0::2] -= ox
        pts[:, 1::2] -= oy
        w = region_weight(pts[None], c, mouth=self.cfg["mouth"], eyes=self.cfg["eyes"],
                          radius=self.cfg["radius"] * size)[0]
        gm = region_weight(pts[None], c, mouth=1.0, eyes=0.0, radius=self.cfg["radius"] * size)[0] - 1.0
        return x, torch.stack([w, gm]), oy, ox

    def sample_predicted(self, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int,
                                                             torch.Tensor]:
        """A batch of the DiT's predicted latents (`predicted`): video `[B, 3, F, c, c]` of the
        trained window, weights, mouth Gaussian, warm-up latent frames W and latents
        `[B, C, W + L, c/8, c/8]` (W context latent frames, decoded without gradients, then the
        window's L). A window at latent frame k ≥ 1 is video frames 4k−3 .. 4k+4L−4 (k = 0:
        frames 0 .. 4L−4, a stream's start)."""
        b, L = self.recipe["train"]["batch"], self.cfg["latent_frames"]
        W = self.cfg["warm_latents"] if self.cfg["warm_latents"] and _rand(g) >= self.cfg["p_stream_start"] else 0
        vids, ws, zs = [], [], []
        for _ in range(b):
            clip = self.pred_clips[_pick(g, len(self.pred_clips))]
            n_lat = self.pred.by_key[clip.key]["latents"]
            k = W + _pick(g, n_lat - L - W + 1) if W else 0
            f0, f1 = (4 * k - 3, 4 * k - 3 + 4 * L) if k else (0, 1 + 4 * (L - 1))
            x = torch.from_numpy(clip.frames[f0:f1]).permute(3, 0, 1, 2).float() / 127.5 - 1
            pts = torch.from_numpy(clip.points[f0:f1])
            z = self.pred.latents(clip.key, _pick(g, self.pred.variants), k - W, W + L)
            size = self.geometry["hr_size"] if self.pred.meta["direct"] else GEOMETRY[self.recipe["model"]]["lr_size"]
            if x.shape[-1] != size:  # an LR DiT's latents: the video at LR
                pts = pts * (size / x.shape[-1])
                x = F.interpolate(x[None], size=(x.shape[1], size, size), mode="area")[0]
            scale = size // z.shape[-1]
            x, w, oy, ox = self._crop(g, x, pts, size, step=scale)
            c = x.shape[-1] // scale
            zs.append(z[:, :, oy // scale:oy // scale + c, ox // scale:ox // scale + c])
            vids.append(x)
            ws.append(w)
        wt = torch.stack(ws).to(self.device)
        return torch.stack(vids).to(self.device), wt[:, 0], wt[:, 1], W, torch.stack(zs).to(self.device)

    def sample(self, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
        """-> video `[B, 3, F, c, c]` in [-1, 1], loss weights `[B, F, c, c]`, the mouth's Gaussian
        alone `[B, F, c, c]` (0..1), warm-up frames W (the
        first W frames are cache context, the rest the trained window; W = 0: a stream's start).
        The whole batch is at HR or (prob p_lr) at LR, warm or not; clips, windows and crops
        differ per element."""
        b = self.recipe["train"]["batch"]
        use_lr = _rand(g) < self.cfg["p_lr"]  # one scale per batch (the batch is stacked)
        warm = self.n_warm_frames if self.n_warm_frames and _rand(g) >= self.cfg["p_stream_start"] else 0
        n = warm + 4 * self.cfg["latent_frames"] if warm else self.n_frames
        vids, ws = [], []
        for _ in range(b):
            clip = self.clips[_pick(g, len(self.clips))]
            s0 = _pick(g, clip.frames.shape[0] - n + 1)
            x = torch.from_numpy(clip.frames[s0:s0 + n]).permute(3, 0, 1, 2).float() / 127.5 - 1
            pts = torch.from_numpy(clip.points[s0:s0 + n]).clone()  # [F, 6]
            size = x.shape[-1]
            if use_lr:
                lr = self.geometry["lr_size"]
                x = F.interpolate(x[None], size=(n, lr, lr), mode="area")[0]
                pts = pts * (lr / size)
                size = lr
            x, w, _, _ = self._crop(g, x, pts, size)
            vids.append(x)
            ws.append(w)
        ws = torch.stack(ws).to(self.device)
        return torch.stack(vids).to(self.device), ws[:, 0], ws[:, 1], warm

    def loss(self, g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        if self.pred is not None and _rand(g) < self.cfg["p_predicted"]:
            x, w, gm, warm, z = self.sample_predicted(g)
            vae: CausalVAE = self.nets["vae"]
            if warm:
                dec = vae.new_cache("decode")
                with torch.no_grad():
                    vae.decode_step(z[:, :, :warm], dec, clamp=False)
                rec = vae.decode_step(z[:, :, warm:], dec, clamp=False).float()
            else:
                rec = vae.decode(z, clamp=False).float()
            return self.recon_loss(rec, x, w, gm, torch.zeros(()), predicted=1.0)
        x, w, gm, warm = self.sample(g)
        vae = self.nets["vae"]
        enc_grad = torch.enable_grad() if self.cfg["train_encoder"] else torch.no_grad()
        if warm:
            # fill the conv caches with the stream's context (no gradients), then train the window
            enc, dec = vae.new_cache("encode"), vae.new_cache("decode")
            with torch.no_grad():
                m0, lv0 = vae.encode_step(x[:, :, :warm], enc)
                vae.decode_step(m0 + torch.exp(0.5 * lv0.float()) * self.randn(g, *m0.shape), dec, clamp=False)
            x, w, gm = x[:, :, warm:], w[:, warm:], gm[:, warm:]
            with enc_grad:
                mean, logvar = vae.encode_step(x, enc)
        else:
            with enc_grad:
                mean, logvar = vae.encode(x)
        eps = self.randn(g, *mean.shape)
        z = mean + torch.exp(0.5 * logvar.float()) * eps
        if self.cfg["latent_noise"] > 0:
            amp = torch.rand(mean.shape[0], generator=g).to(self.device) * self.cfg["latent_noise"]
            z = z + amp.view(-1, 1, 1, 1, 1) * mean.detach().float().std() * self.randn(g, *mean.shape)
        rec = (vae.decode_step(z, dec, clamp=False) if warm else vae.decode(z, clamp=False)).float()
        kl = 0.5 * (mean.float().square() + logvar.float().exp() - 1 - logvar.float()).mean()
        return self.recon_loss(rec, x, w, gm, kl)

    def recon_loss(self, rec: torch.Tensor, x: torch.Tensor, w: torch.Tensor, gm: torch.Tensor,
                   kl: torch.Tensor, predicted: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
        """The weighted reconstruction terms of decoded `rec` against video `x` (see the class
        docstring) + kl · KL; logs (`predicted`: 1 on a batch of a DiT's latents)."""
        err = rec - x
        wn = w / w.mean()
        l1 = (err.abs().mean(1) * wn).mean()
        dxr, dxx = rec.diff(dim=-1), x.diff(dim=-1)
        dyr, dyx = rec.diff(dim=-2), x.diff(dim=-2)
        grad = (((dxr - dxx).abs().mean(1) * wn[..., :, 1:]).mean()
                + ((dyr - dyx).abs().mean(1) * wn[..., 1:, :]).mean())
        ms = 0.0
        for k in (2, 4):
            if x.shape[-1] // k >= 2:
                pr = F.avg_pool3d(rec, (1, k, k))
                px = F.avg_pool3d(x, (1, k, k))
                ms = ms + (pr - px).abs().mean()
        # frame-to-frame change, weighted like L1 (a moving mouth is a small part of the picture)
        dt = (rec.diff(dim=2) - x.diff(dim=2)).abs().mean(1)  # [B, F-1, c, c]
        temporal = (dt * wn[:, 1:]).mean()
        # the mouth's motion alone: the frame-to-frame change inside the mouth's Gaussian, which
        # the whole-picture term dilutes with the flicker of everything else (0 when no mouth).
        # Squared, not L1: the change is small on most pixels and L1's optimum there is no
        # change at all (measured: an L1 version held the round trip's motion inside a latent's
        # 4 frames at 0 % of the ground truth's; squared, it grows)
        gmt = gm[:, 1:]
        dt2 = (rec.diff(dim=2) - x.diff(dim=2)).square().mean(1)
        mouth_temporal = (dt2 * gmt).sum() / gmt.sum().clamp_min(1.0)
        c = self.cfg
        total = (l1 + c["grad"] * grad + c["multiscale"] * ms + c["temporal"] * temporal
                 + c["mouth_temporal"] * mouth_temporal + c["kl"] * kl)
        f = lambda t: float(t.detach()) if isinstance(t, torch.Tensor) else float(t)  # noqa: E731
        return total, {"loss": f(total), "l1": f(l1), "grad": f(grad), "ms": f(ms),
                       "temporal": f(temporal), "mouth_temporal": f(mouth_temporal), "kl": f(kl),
                       "psnr": f(-10 * torch.log10(err.clamp(-2, 2).square().mean() / 4 + 1e-12)),
                       **({"predicted": predicted} if self.pred is not None else {})}


# ---------------------------------------------------------------------------------------------
class _LatentTask(Task):
    """Shared by a2v and sr: prepared data, windows, references, audio/text conditioning."""

    def __init__(self, recipe: dict[str, Any], device: torch.device) -> None:
        super().__init__(recipe, device)
        d = recipe["data"]
        if not d["prepared"]:
            raise ConfigError(f"the {self.stage} recipe needs data.prepared (a file made by "
                              "`avatarstream train prepare`)")
        self.data = PreparedData(d["prepared"])
        g = GEOMETRY[recipe["model"]]
        if self.data.lr_size != g["lr_size"] or self.data.hr_size != g["hr_size"]:
            raise ConfigError(f"{d['prepared']} holds {self.data.lr_size}/{self.data.hr_size} px latents; "
                              f"model {recipe['model']} wants {g['lr_size']}/{g['hr_size']}")
        if self.direct:
            self.data.use_hr_as_lr()
        c_model = getattr(DiTConfig, recipe["model"])().in_channels
        if self.data.latent_channels != c_model:
            raise ConfigError(f"{d['prepared']}: {self.data.latent_channels} latent channels, "
                              f"model {recipe['model']} wants {c_model}")
        self.T = self.cfg["chunk"]
        self.clip_ids = self.data.usable(self.T)
        if not self.clip_ids:
            raise ConfigError(f"no clip in {d['prepared']} has {self.T} latent frames (chunk too long)")
        self.motion_dim = getattr(DiTConfig, recipe["model"])().motion_dim

    def window(self, g: torch.Generator) -> tuple[int, int]:
        i = self.clip_ids[_pick(g, len(self.clip_ids))]
        return i, _pick(g, self.data.clips[i]["latents"] - self.T + 1)

    def reference(self, g: torch.Generator, i: int, hr: bool, p_cross: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """Reference of clip i: latents `[C, R, h, w]` of the first R frames of another clip of
        the same identity in another scene (prob p_cross, when one exists; else clip i), a valid
        mask `[R]` keeping a random 1..R prefix, its motion descriptor `[R, Dm]`, cross?"""
        R = self.cfg["ref_frames"]
        j, cross = self.data.other_scene(i, g) if _rand(g) < p_cross else (i, False)
        n = min(R, self.data.clips[j]["latents"])
        keep = 1 + _pick(g, n)
        lat = torch.zeros(self.data.latent_channels, R, *self.data.latents(j, 0, 1, hr).shape[-2:])
        lat[:, :n] = self.data.latents(j, 0, n, hr)
        valid = torch.zeros(R, dtype=torch.bool)
        valid[:keep] = True
        mot = torch.zeros(R, self.motion_dim)
        mot[:n] = motion_descriptor(self.data.table(j), torch.arange(n), self.motion_dim)
        return lat, valid, mot, cross

    def scene_anchor(self, clips: list[int]) -> torch.Tensor:
        """`[B, C, h, w]` LR latent of each clip's first frame: the scene frame the engine gives
        the DiT as its anchor (a one-image latent, as the engine encodes the reference's first
        frame or `--scene`), whatever window of the clip is trained."""
        return torch.stack([self.data.latents(i, 0, 1)[:, 0] for i in clips]).to(self.device)

    def audio_tokens(self, audio: AudioEncoder, clips: list[int], starts: list[int], drop: torch.Tensor
                     ) -> torch.Tensor:
        """`[B, T, 4 + 2w, Da]` tokens of latent positions start..start+T−1 of each clip
        (features of the zero-extended waveform, as the engine computes them); rows of `drop`
        (bool `[B]`) zeroed (audio-free condition for CFG)."""
        w = self.cfg["audio_window"]
        out = []
        for i, p0 in zip(clips, starts):
            a = latent_frame_range(p0, w)[0]
            b = latent_frame_range(p0 + self.T - 1, w)[1]
            wave = self.data.wave_of(i)[None].to(self.device)
            feats = audio.frames(wave, a, b)  # [1, b - a, Da]
            out.append(group_per_latent(feats, list(range(p0, p0 + self.T)), w, first_frame=a))
        tok = torch.cat(out)
        return tok * (~drop).to(tok.dtype).to(self.device)[:, None, None, None]

    def text_tokens(self, text: TextEncoder, g: torch.Generator, clips: list[int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        prompts = ["" if _rand(g) < self.cfg["p_empty_text"] else self.data.clips[i]["prompt"] for i in clips]
        return text.encode(prompts)

    def latent_weight(self, clips: list[int], starts: list[int], size: int) -> torch.Tensor:
        """Mouth/eye weight map `[B, 1, T, size, size]` in latent pixels (normalised to mean 1)."""
        scale = size / self.data.hr_size
        pts = torch.stack([_latent_points(self.data.table(i), list(range(p0, p0 + self.T)), scale)
                           for i, p0 in zip(clips, starts)])  # [B, T, 6]
        w = region_weight(pts, size, mouth=self.cfg["mouth"], eyes=self.cfg["eyes"],
                          radius=max(0.5, self.cfg["radius"] * size))
        return (w / w.mean()).unsqueeze(1).to(self.device)


class A2VTask(_LatentTask):
    """Audio-to-video flow matching of the VideoRef DiT (+ AudioEncoder and TextEncoder trained
    jointly).

    Per element: a window of `chunk` latent frames, σ ~ logit-normal(logit_mean, logit_std)
    shared by the chunk's generated frames, a frame-conditioning mask (ref2v: frame 0 given, the
    driving scene image, when `first_frame` (else none), the window then starting at the clip's
    first latent with p_clip_start;
    prefix2v: the first `overlap`; interpolation: first and last) whose given frames are clean
    (σ = 0) and excluded from the loss, a cross-scene reference (see `reference`), condition
    dropout for classifier-free guidance (audio tokens zeroed with p_drop_audio, every reference
    key masked with p_drop_ref — the same as no reference — and the empty prompt with
    p_empty_text). Personality SFT is this task with `p_cross_scene = 1` started from a
    pre-training run (`[init]`).
    Loss = weighted MSE(v̂, ε − x0) over generated frames (mouth/eye-weighted)
         + motion · MSE(motion velocity, ε_m − m0) over generated frames
         + ref_motion · MSE(reference motion tokens, reference motion descriptor) over valid frames.
    """

    stage = "a2v"

    def __init__(self, recipe: dict[str, Any], device: torch.device) -> None:
        c = recipe["a2v"]
        t = ["dit"]
        if c["train_audio"]:
            t.append("audio")
        if c["train_text"]:
            t.append("text")
        self.trainable = tuple(t)
        super().__init__(recipe, device)
        p = [c["p_ref2v"], c["p_prefix"], c["p_interp"]]
        if min(p) < 0 or sum(p) <= 0:
            raise ConfigError("a2v: p_ref2v, p_prefix, p_interp must be >= 0 with a positive sum")
        if self.T < max(3, c["overlap"] + 1):
            raise ConfigError("a2v: chunk must exceed overlap and be at least 3")
        self.mode_p = torch.tensor(p, dtype=torch.float64) / sum(p)
        self.human = None
        if c["human_sync"] > 0 or c["human_identity"] > 0:
            from avatarstream.train.human import HumanLoss

            if c["human_context"] < 1:
                raise ConfigError("a2v: human_context must be at least 1 (the decoder needs the window's past)")
            if not self.data.vae_state:
                raise ConfigError(f"{recipe['data']['prepared']}: no VAE inside (needed by human_sync/"
                                  "human_identity); re-run `avatarstream train prepare`")
            vae = vae_for(recipe["model"], self.data.vae_state)
            self.human = HumanLoss(vae.to(device), context=c["human_context"])

    def uses(self) -> tuple[str, ...]:
        return ("dit", "audio", "text")

    def given_mask(self, g: torch.Generator) -> tuple[torch.Tensor, int]:
        mode = int(torch.multinomial(self.mode_p, 1, generator=g))
        m = torch.zeros(self.T, dtype=torch.bool)
        if mode == 0 and self.cfg["first_frame"]:
            m[0] = True  # the driving scene image (Avatar V's I2V first chunk)
        elif mode == 1:
            m[: self.cfg["overlap"]] = True
        elif mode == 2:
            m[0] = m[-1] = True
        return m, mode

    def batch(self, g: torch.Generator) -> dict[str, Any]:
        """Everything one step needs, drawn from g: clean latents `x0 [B,C,T,h,w]`, motion
        `m0 [B,T,Dm]`, noisy `xs`, `ms`, noise `eps`, `eps_m`, `sigma [B,T]`, `given [B,T]`,
        audio tokens `[B,T,A,Da]` (zeroed rows: dropped audio), text tokens/mask, reference
        latents `[B,C,R,h,w]`, `ref_valid [B,R]` (all False: dropped reference), descriptors."""
        c, B, T = self.cfg, self.recipe["train"]["batch"], self.T
        clips, starts, x0, m0, given, refs, valids, ref_mot, cross = [], [], [], [], [], [], [], [], 0
        for _ in range(B):
            i, p0 = self.window(g)
            gm, mode = self.given_mask(g)
            if mode == 0 and c["first_frame"] and _rand(g) < c["p_clip_start"]:
                p0 = 0  # the scene frame is then a one-image latent, as the engine encodes it
            clips.append(i)
            starts.append(p0)
            x0.append(self.data.latents(i, p0, T))
            m0.append(motion_descriptor(self.data.table(i), torch.arange(p0, p0 + T), self.motion_dim))
            given.append(gm)
            lat, valid, mot, cr = self.reference(g, i, hr=False, p_cross=c["p_cross_scene"])
            refs.append(lat)
            valids.append(valid)
            ref_mot.append(mot)
            cross += int(cr)
        b: dict[str, Any] = {"clips": clips, "starts": starts, "cross": cross / B}
        b["x0"] = x0t = torch.stack(x0).to(self.device)
        b["m0"] = m0t = torch.stack(m0).to(self.device)
        b["given"] = given_t = torch.stack(given).to(self.device)
        u = torch.randn(B, generator=g) * c["logit_std"] + c["logit_mean"]
        b["sig"] = sig = torch.sigmoid(u).to(self.device)  # [B] logit-normal
        b["sigma"] = sigma = sig[:, None].expand(B, T).masked_fill(given_t, 0.0)  # [B, T]
        b["eps"] = eps = self.randn(g, *x0t.shape)
        b["eps_m"] = eps_m = self.randn(g, *m0t.shape)
        s5 = sigma[:, None, :, None, None]
        b["xs"] = (1 - s5) * x0t + s5 * eps
        b["ms"] = (1 - sigma[..., None]) * m0t + sigma[..., None] * eps_m
        drop_a = torch.rand(B, generator=g) < c["p_drop_audio"]
        drop_r = torch.rand(B, generator=g) < c["p_drop_ref"]
        grad = torch.enable_grad() if "audio" in self.trainable else torch.no_grad()
        with grad:
            b["audio"] = self.audio_tokens(self.nets["audio"], clips, starts, drop_a)
        with torch.enable_grad() if "text" in self.trainable else torch.no_grad():
            b["text"], b["text_mask"] = self.text_tokens(self.nets["text"], g, clips)
        b["ref_lat"] = torch.stack(refs).to(self.device)
        b["ref_valid"] = (torch.stack(valids) & ~drop_r[:, None]).to(self.device)
        b["ref_mot"] = torch.stack(ref_mot).to(self.device)
        b["weight"] = self.latent_weight(clips, starts, x0t.shape[-1])  # [B, 1, T, h, w]
        b["anchor"] = self.scene_anchor(clips)
        return b

    def predict(self, dit: VideoRefDiT, b: dict[str, Any], *, audio: bool = True, ref: bool = True,  # type: ignore[no-untyped-def]
                guidance: torch.Tensor | None = None):
        """(DiTOutput, ReferenceCache | None) of `dit` on batch b, with the audio and/or reference
        stream dropped for every element when asked (CFG streams); guidance `[B, 2]`: the CFG
        scales of a distilled student."""
        c, T = self.cfg, self.T
        cache = None
        if ref:
            t_ref = torch.full((b["ref_lat"].shape[2],), float(c["ref_t_position"]))
            cache = dit.encode_reference(b["ref_lat"], b["ref_valid"], t_ref)
        tok = b["audio"] if audio else torch.zeros_like(b["audio"])
        cond = DiTCondition(motion=b["ms"], audio=tok, text=b["text"], text_mask=b["text_mask"],
                            t_pos=torch.arange(T, dtype=torch.float32, device=self.device), guidance=guidance,
                            anchor=b["anchor"])
        return dit(b["xs"], b["sigma"], cond, cache), cache

    def flow_losses(self, b: dict[str, Any], v: torch.Tensor, mv: torch.Tensor, v_target: torch.Tensor,
                    mv_target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mouth/eye-weighted MSE of v `[B,C,T,h,w]` and MSE of mv `[B,T,Dm]` over generated
        frames (an `x0_skip` DiT's weighted by `x0_floor_weight`)."""
        gen = (~b["given"]).float()  # [B, T]
        w = b["weight"] * gen[:, None, :, None, None] * x0_floor_weight(b["sigma"], self.nets["dit"].config.x0_skip)
        loss_v = ((v.float() - v_target).square() * w).sum() / (w.sum() * v.shape[1]).clamp_min(1)
        m_err = (mv.float() - mv_target).square().mean(-1)
        return loss_v, (m_err * gen).sum() / gen.sum().clamp_min(1)

    def loss(self, g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        c = self.cfg
        b = self.batch(g)
        out, cache = self.predict(self.nets["dit"], b)
        loss_v, loss_m = self.flow_losses(b, out.velocity, out.motion_velocity, b["eps"] - b["x0"],
                                          b["eps_m"] - b["m0"])
        valid = b["ref_valid"]
        keep = valid.any(0)  # frames encode_reference kept
        rv = valid[:, keep].float()
        if cache is not None and cache.motion.shape[1] > 0:
            rm_err = (cache.motion.float() - b["ref_mot"][:, keep]).square().mean(-1)
            loss_rm = (rm_err * rv).sum() / rv.sum().clamp_min(1)
        else:
            loss_rm = torch.zeros((), device=self.device)
        total = loss_v + c["motion"] * loss_m + c["ref_motion"] * loss_rm
        logs = {"loss": 0.0, "flow": float(loss_v.detach()), "motion": float(loss_m.detach()),
                "ref_motion": float(loss_rm.detach()), "sigma": float(b["sig"].mean()), "cross_scene": b["cross"]}
        if self.human is not None and _rand(g) < c["p_human"]:
            sync, ident = self.human_losses(b, out.velocity)
            total = total + c["human_sync"] * sync + c["human_identity"] * ident
            logs.update(human_sync=float(sync.detach()), human_identity=float(ident.detach()))
        logs["loss"] = float(total.detach())
        return total, logs

    def human_losses(self, b: dict[str, Any], v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert losses (train/human.py) on the batch's first element: its clean estimate
        x̂0 = x_σ − σ·v̂ decoded after up to `human_context` clean latents of the same clip."""
        i, p0 = b["clips"][0], b["starts"][0]
        s5 = b["sigma"][:1, None, :, None, None]
        x0_hat = b["xs"][:1] - s5 * v[:1].float()
        k = min(self.cfg["human_context"], p0)
        ctx = self.data.latents(i, p0 - k, k)[None].to(self.device) if k > 0 else None
        return self.human(x0_hat, b["x0"][:1], ctx, p0, self.data.wave_of(i))


class CFGDistillTask(A2VTask):
    """CFG distillation (Avatar V sec. 3.4): fold the audio and reference guidance streams into one
    forward pass. Teacher = the DiT of `init.dit` (frozen), student = the same weights (trained);
    audio and text encoders frozen (from `init`). Per batch the teacher runs three streams,
    full `v(a, r)`, audio dropped `v(∅, r)`, both dropped `v(∅, ∅)`, and the target is

        v_cfg = v(∅, ∅) + ref_scale · (v(∅, r) − v(∅, ∅)) + audio_scale · (v(a, r) − v(∅, r))

    (same for the motion velocity); loss = weighted MSE(student v(a, r), v_cfg) + motion ·
    MSE(motion). With `guidance_input` (default) the scales are the student's inputs: drawn per
    sample from [audio_scale_min, audio_scale_max] x [ref_scale_min, ref_scale_max] and given to
    it as `DiTCondition.guidance`, so one forward pass serves any scale at inference (the engine's
    `--audio-scale` / `--ref-scale`; `audio_scale` / `ref_scale` are the exported defaults).
    Without it the scales are fixed per run. The student's guidance embedding starts at zero, so
    it starts as the teacher. The teacher must have been trained with audio/reference dropout
    (a2v `p_drop_audio`, `p_drop_ref`)."""

    stage = "cfg-distill"
    trainable = ("dit",)

    def __init__(self, recipe: dict[str, Any], device: torch.device) -> None:
        if not recipe["init"]["dit"]:
            raise ConfigError("the cfg-distill recipe needs init.dit (the a2v run or weights to distill)")
        _LatentTask.__init__(self, recipe, device)
        c = recipe["cfg-distill"]
        p = [c["p_ref2v"], c["p_prefix"], c["p_interp"]]
        self.mode_p = torch.tensor(p, dtype=torch.float64) / max(sum(p), 1e-9)
        self.nets["teacher"] = VideoRefDiT(dit_config(recipe["model"], self.direct))

    def uses(self) -> tuple[str, ...]:
        return ("dit", "audio", "text")

    def after_init(self) -> None:
        with torch.no_grad():  # the student starts as the teacher, whatever the scales
            self.nets["dit"].guidance_embedding[2].weight.zero_()
            self.nets["dit"].guidance_embedding[2].bias.zero_()
        self.nets["teacher"].load_state_dict(self.nets["dit"].state_dict())

    def scales(self, g: torch.Generator, batch: int) -> torch.Tensor:
        """`[B, 2]` (audio, reference) guidance scales of a step's samples."""
        c = self.cfg
        if not c["guidance_input"]:
            return torch.tensor([[c["audio_scale"], c["ref_scale"]]]).expand(batch, 2)
        u = torch.rand(batch, 2, generator=g)
        lo = torch.tensor([c["audio_scale_min"], c["ref_scale_min"]])
        hi = torch.tensor([c["audio_scale_max"], c["ref_scale_max"]])
        return lo + u * (hi - lo)

    def loss(self, g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        c = self.cfg
        b = self.batch(g)
        teacher = self.nets["teacher"]
        s = self.scales(g, b["xs"].shape[0]).to(self.device)  # [B, 2]

        def guide(full: torch.Tensor, no_a: torch.Tensor, none: torch.Tensor) -> torch.Tensor:
            shape = (-1,) + (1,) * (full.dim() - 1)
            a, r = s[:, 0].reshape(shape), s[:, 1].reshape(shape)
            return none.float() + r * (no_a.float() - none.float()) + a * (full.float() - no_a.float())

        with torch.no_grad():
            full, _ = self.predict(teacher, b)
            no_a, _ = self.predict(teacher, b, audio=False)
            if bool((s[:, 1] == 1.0).all()):  # reference scale 1: v(∅, ∅) cancels out, skip its pass
                none = no_a
            else:
                none, _ = self.predict(teacher, b, audio=False, ref=False)
            v_cfg = guide(full.velocity, no_a.velocity, none.velocity)
            mv_cfg = guide(full.motion_velocity, no_a.motion_velocity, none.motion_velocity)
        out, _ = self.predict(self.nets["dit"], b, guidance=s if c["guidance_input"] else None)
        loss_v, loss_m = self.flow_losses(b, out.velocity, out.motion_velocity, v_cfg, mv_cfg)
        total = loss_v + c["motion"] * loss_m
        gap = (full.velocity.float() - v_cfg).square().mean()
        return total, {"loss": float(total.detach()), "flow": float(loss_v.detach()),
                       "motion": float(loss_m.detach()), "teacher_gap": float(gap),
                       "sigma": float(b["sig"].mean())}


class SRTask(_LatentTask):
    """Super-resolution refiner, one step from σ = 0.6: `x = (1 − σ) up(lr') + σ ε` with lr' the
    window's LR latents plus N(0, lr_noise²) (a stand-in for the DiT's errors), `x0̂ = x − σ v̂`,
    loss = mouth/eye-weighted MSE(x0̂, HR latents). σ jitters in ±sigma_jitter with prob
    p_sigma_jitter (robustness); audio/text encoders are frozen (from `[init]`, e.g. an a2v run);
    motion tokens are the clean motion descriptor (what the DiT outputs at inference)."""

    stage = "sr"
    trainable = ("refiner",)

    def uses(self) -> tuple[str, ...]:
        return ("refiner", "audio", "text")

    def loss(self, g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        c, B, T = self.cfg, self.recipe["train"]["batch"], self.T
        ref_net: SRRefiner = self.nets["refiner"]
        clips, starts, lr, hr, mot, refs, valids = [], [], [], [], [], [], []
        for _ in range(B):
            i, p0 = self.window(g)
            clips.append(i)
            starts.append(p0)
            lr.append(self.data.latents(i, p0, T))
            hr.append(self.data.latents(i, p0, T, hr=True))
            mot.append(motion_descriptor(self.data.table(i), torch.arange(p0, p0 + T), self.motion_dim))
            lat, valid, _, _ = self.reference(g, i, hr=True, p_cross=1.0)
            refs.append(lat)
            valids.append(valid)
        lr_t = torch.stack(lr).to(self.device)
        hr_t = torch.stack(hr).to(self.device)
        sig = torch.full((B,), float(c["sigma"]))
        jit = torch.rand(B, generator=g) < c["p_sigma_jitter"]
        sig = torch.where(jit, sig + (2 * torch.rand(B, generator=g) - 1) * c["sigma_jitter"], sig)
        sig = sig.clamp(0.05, 0.95).to(self.device)
        lr_in = lr_t + c["lr_noise"] * self.randn(g, *lr_t.shape)
        up = upsample2x(lr_in)
        eps = self.randn(g, *hr_t.shape)
        s5 = sig[:, None, None, None, None]
        x = (1 - s5) * up + s5 * eps
        with torch.no_grad():
            audio = self.audio_tokens(self.nets["audio"], clips, starts, torch.zeros(B, dtype=torch.bool))
            text, tmask = self.text_tokens(self.nets["text"], g, clips)
        ref_lat = torch.stack(refs).to(self.device)
        t_ref = torch.full((ref_lat.shape[2],), float(c["ref_t_position"]))
        ref = ref_net.encode_reference(ref_lat, torch.stack(valids).to(self.device), t_ref)
        cond = DiTCondition(motion=torch.stack(mot).to(self.device), audio=audio, text=text,
                            text_mask=tmask, t_pos=torch.arange(T, dtype=torch.float32, device=self.device))
        v = ref_net(x, up, sig[:, None].expand(B, T), cond, ref).float()
        x0 = x - s5 * v
        w = self.latent_weight(clips, starts, hr_t.shape[-1])
        loss = ((x0 - hr_t).square() * w).mean()
        base = (up - hr_t).square().mean()
        return loss, {"loss": float(loss.detach()), "upsample_mse": float(base), "sigma": float(sig.mean())}


TASKS = {"vae": VAETask, "a2v": A2VTask, "sr": SRTask, "cfg-distill": CFGDistillTask}


def make_task(recipe: dict[str, Any], device: torch.device) -> Task:
    if recipe["stage"] in ("df", "dmd"):  # the causal student's stages (train/causal_tasks.py)
        from avatarstream.train.causal_tasks import CAUSAL_TASKS

        if recipe["stage"] == "dmd":
            strategy = recipe["dmd"]["strategy"]
            if strategy not in ("causal", "prefix"):
                raise ConfigError(f"dmd.strategy must be \"causal\" or \"prefix\", got {strategy!r}")
            if strategy == "prefix":  # a bidirectional student (train/prefix_dmd.py)
                from avatarstream.train.prefix_dmd import PrefixDMDTask

                return PrefixDMDTask(recipe, device)
        return CAUSAL_TASKS[recipe["stage"]](recipe, device)
    return TASKS[recipe["stage"]](recipe, device)


__all__ = ["NETS", "GEOMETRY", "Task", "VAETask", "A2VTask", "SRTask", "CFGDistillTask", "make_task", "build_nets",
           "init_net"]
