"""The causal VAE's objective (`stage = "vae"`): reconstruction of pixel clips from synthetic
shards, weighted towards the mouth and eyes, trained on windows that continue a warm stream the
way the engine decodes one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from avatarstream.errors import ConfigError
from avatarstream.train.data import PixelClip, load_pixel_clips, region_weight
from avatarstream.train.objectives.base import Task, pick, uniform


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

    def _crop(self, g: torch.Generator, x: torch.Tensor, pts: torch.Tensor, size: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Crop of video `[3, F, S, S]` (`crop`², around the mouth with prob p_mouth_crop) ->
        (video `[3, F, c, c]`, weights `[2, F, c, c]`: loss weight and mouth Gaussian)."""
        c = min(self.cfg["crop"], size)
        if c < size and uniform(g) < self.cfg["p_mouth_crop"]:
            # the mouth (its mean position over the window) lands in the crop's central half
            mx, my = (float(v) for v in pts[:, :2].mean(0))
            ox = min(max(int(mx) - c // 4 - pick(g, c // 2 + 1), 0), size - c)
            oy = min(max(int(my) - c // 4 - pick(g, c // 2 + 1), 0), size - c)
        else:
            oy, ox = pick(g, size - c + 1), pick(g, size - c + 1)
        x = x[:, :, oy:oy + c, ox:ox + c]
        pts = pts.clone()
        pts[:, 0::2] -= ox
        pts[:, 1::2] -= oy
        w = region_weight(pts[None], c, mouth=self.cfg["mouth"], eyes=self.cfg["eyes"],
                          radius=self.cfg["radius"] * size)[0]
        gm = region_weight(pts[None], c, mouth=1.0, eyes=0.0, radius=self.cfg["radius"] * size)[0] - 1.0
        return x, torch.stack([w, gm])

    def sample(self, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """-> video `[B, 3, F, c, c]` in [-1, 1], loss weights `[B, F, c, c]`, the mouth's Gaussian
        alone `[B, F, c, c]` (0..1), warm-up frames W (the
        first W frames are cache context, the rest the trained window; W = 0: a stream's start).
        The whole batch is at HR or (prob p_lr) at LR, warm or not; clips, windows and crops
        differ per element."""
        b = self.recipe["train"]["batch"]
        use_lr = uniform(g) < self.cfg["p_lr"]  # one scale per batch (the batch is stacked)
        warm = self.n_warm_frames if self.n_warm_frames and uniform(g) >= self.cfg["p_stream_start"] else 0
        n = warm + 4 * self.cfg["latent_frames"] if warm else self.n_frames
        vids, ws = [], []
        for _ in range(b):
            clip = self.clips[pick(g, len(self.clips))]
            s0 = pick(g, clip.frames.shape[0] - n + 1)
            x = torch.from_numpy(clip.frames[s0:s0 + n]).permute(3, 0, 1, 2).float() / 127.5 - 1
            pts = torch.from_numpy(clip.points[s0:s0 + n]).clone()  # [F, 6]
            size = x.shape[-1]
            if use_lr:
                lr = self.geometry["lr_size"]
                x = F.interpolate(x[None], size=(n, lr, lr), mode="area")[0]
                pts = pts * (lr / size)
                size = lr
            x, w = self._crop(g, x, pts, size)
            vids.append(x)
            ws.append(w)
        ws = torch.stack(ws).to(self.device)
        return torch.stack(vids).to(self.device), ws[:, 0], ws[:, 1], warm

    def loss(self, g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
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
                   kl: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """The weighted reconstruction terms of decoded `rec` against video `x` (see the class
        docstring) + kl · KL; logs."""
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
                       "psnr": f(-10 * torch.log10(err.clamp(-2, 2).square().mean() / 4 + 1e-12))}
