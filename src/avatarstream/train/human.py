"""Human-aware auxiliary losses of the a2v recipes: the expert networks judge decoded pixels.

The DiT's flow prediction gives a clean-latent estimate x̂0 = x_σ − σ·v̂. For one element of the
batch the frozen VAE (the prepared file's: latent statistics folded in) decodes x̂0 to pixels and
the frozen evaluation experts score them:

- **lip sync**: SyncNet's video embedding of each 5-frame mouth window against the audio embedding
  of the same 0.2 s of the clip's speech; loss = mean cosine distance (1 − cos) over the windows.
- **identity**: IdentityNet's embedding of the decoded faces against that of the ground-truth
  frames' faces (same identity and scene); loss = mean cosine distance.

Crop boxes come from the expert locator run on the decoded *ground truth* (no gradient through
the boxes). The decoder's conv caches are first warmed with up to `context` clean latents before
the window (no grad), so x̂0 is decoded in the streaming steady state the engine decodes in, not as
a cold stream start (a causal VAE decodes a window's first latents badly without its past).

Caveat, stated in the model card: these are the experts `eval` measures Sync-C and FaceSim with;
at a small weight they shape the gradient, but a model could in principle learn to please them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from avatarstream.eval.experts import (CANVAS, FACE_SIZE, SYNC_SIZE, Experts, audio_mel, crop, face_box, grey,
                                       load_experts, mel_windows, video_windows)
from avatarstream.models.vae import CausalVAE

SAMPLES_PER_FRAME = 640  # 16 kHz / 25 fps


class HumanLoss:
    def __init__(self, vae: CausalVAE, *, context: int = 4, experts: Experts | None = None) -> None:
        self.vae = vae.eval().requires_grad_(False)
        self.ex = experts or load_experts()
        for net in (self.ex.face, self.ex.sync, self.ex.identity):
            net.eval().requires_grad_(False)
        self.context = context

    def decode(self, ctx: torch.Tensor | None, x: torch.Tensor, *, grad: bool) -> tuple[torch.Tensor, int]:
        """Decode latents x [1, C, T, h, w] after warming the caches with ctx [1, C, k, h, w] (or
        None: x starts a stream). -> (canvas [F, 3, 256, 256] in [0, 1], first video frame of x
        relative to x's first latent's group)."""
        cache = self.vae.new_cache("decode")
        if ctx is not None and ctx.shape[2] > 0:
            with torch.no_grad():
                self.vae.decode_step(ctx, cache, clamp=False)
        with torch.set_grad_enabled(grad):
            v = self.vae.decode_step(x, cache, clamp=False).clamp(-1.0, 1.0)  # [1, 3, F, H, W]
        f = v[0].transpose(0, 1).float().add(1.0).mul(0.5)  # [F, 3, H, W]
        if f.shape[-1] != CANVAS:
            f = F.interpolate(f, size=(CANVAS, CANVAS), mode="bilinear", align_corners=False)
        return f

    def __call__(self, x0_hat: torch.Tensor, x0: torch.Tensor, ctx: torch.Tensor | None, p0: int,
                 wave: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x0_hat, x0 [1, C, T, h, w] (prediction with grad, ground truth); ctx: clean latents just
        before the window (or None when p0 − k = 0 start); p0: the window's first latent position
        in its clip; wave: the clip's 16 kHz waveform. -> (sync loss, identity loss)."""
        gt = self.decode(ctx, x0, grad=False)
        pred = self.decode(ctx, x0_hat, grad=True)
        # video frame index of the decoded window's first frame: a stream start (p0 = 0, no
        # context) yields frame 0; after context, latent p0 decodes frames 4·p0 − 3 .. 4·p0
        start = 0 if (p0 == 0) else 4 * p0 - 3
        n = pred.shape[0]
        with torch.no_grad():
            loc = self.ex.face.locate(gt)
            loc = loc.median(0, keepdim=True).values.expand(n, 3)  # one box: steadier than per frame
            mx, my, a = loc[:, 0], loc[:, 1], loc[:, 2]
            id_gt = F.normalize(self.ex.identity(crop(gt, *face_box(mx, my, a), FACE_SIZE)).mean(0), dim=0)
            seg = wave[start * SAMPLES_PER_FRAME:(start + n) * SAMPLES_PER_FRAME]
            ea = self.ex.sync.embed_audio(mel_windows(audio_mel(seg), n))[2:n - 2]
        mouths = grey(crop(pred, mx, my, 2.2 * a, SYNC_SIZE))
        ev = self.ex.sync.embed_video(video_windows(mouths))[2:n - 2]
        sync = (1.0 - (ev * ea).sum(1)).mean()
        idp = self.ex.identity(crop(pred, *face_box(mx, my, a), FACE_SIZE))
        ident = (1.0 - idp @ id_gt).mean()
        return sync, ident
