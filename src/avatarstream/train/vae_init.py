"""Training-side surgery on the causal VAE (`models/vae.py`): the weights a fresh VAE starts
training from, and the change of latent coordinates `train prepare` bakes into a trained one.

Neither is needed to load or run a VAE: an exported VAE already has its statistics folded in,
and inference never initialises one (the registry's random weights are `CausalVAE.init_random_`).
"""

from __future__ import annotations

import torch
from torch import nn

from avatarstream.models.vae import CausalVAE
from avatarstream.models.vae_blocks import Downsample, FrameAttention, ResnetBlock, Upsample


def _tenth(*mods: nn.Module | None) -> None:
    """Branch outputs at a tenth of their random init, not at zero: a chain of zero layers passes
    no gradient, and the latent channels the pooled path leaves empty would start dead
    (measured: PSNR flat for the first hundred steps)."""
    for m in mods:
        if m is not None:
            for p in m.parameters():
                p.mul_(0.1)


def _pass_through(conv: nn.Module, tap: tuple[int, ...]) -> None:
    """conv weight [out, in, *k] -> channel c to channel c (c < min(in, out)) at `tap`."""
    conv.weight.zero_()
    conv.bias.zero_()
    n = min(conv.weight.shape[0], conv.weight.shape[1])
    for c in range(n):
        conv.weight[(c, c) + tap] = 1.0


@torch.no_grad()
def init_pooling_(vae: CausalVAE, seed: int = 0) -> CausalVAE:
    """Training init of a VAE with `shortcuts`: random weights (`init_random_`), then every
    residual branch's last layer scaled down and the few linear maps on the shortcut path set to
    pass channels through, so that at step 0 the VAE *is* the parameter-free path: encode =
    8×8 (and ×4 in time) average pooling of the RGB values into 3 of the latent channels,
    decode = nearest-neighbour unpooling, plus small random branches (a tenth of their
    random init) through which the detail is learned. Training then learns the detail on top of a
    colour-correct reconstruction instead of from noise (measured on the small preset: the
    random init starts at 1 dB crop PSNR, this one at the pooled image's)."""
    vae.init_random_(seed)
    if not vae.cfg.shortcuts:
        raise ValueError("init_pooling_ needs a VAE with shortcuts")
    for m in vae.modules():
        if isinstance(m, ResnetBlock):
            _tenth(m.conv2)
            if m.conv_shortcut is not None:
                _pass_through(m.conv_shortcut, (0, 0, 0))
        elif isinstance(m, FrameAttention):
            _tenth(m.proj)
        elif isinstance(m, (Downsample, Upsample)):
            _tenth(m.resample, m.time_conv)
    enc, dec = vae.encoder, vae.decoder
    _pass_through(enc.conv_in, (2, 1, 1))  # the current frame's pixel, causal kernel
    _tenth(enc.head.conv, dec.conv_in, dec.head.conv)
    _pass_through(vae.quant_conv, (0, 0, 0))
    # a near-deterministic posterior to start with (std e^-4 ≈ 0.02 against latents of
    # ≈ 0.2): unit noise would bury the pooled colours the latent starts with
    vae.quant_conv.bias[vae.cfg.z_channels:] = -8.0
    _pass_through(vae.post_quant_conv, (0, 0, 0))
    # decoder head skip: the unpooled colour channels (R, G, B = channels 0, 1, 2 after the
    # upsamplers' channel unfolding) to every sub-pixel of the pixel patch
    skip = dec.head.skip
    skip.weight.zero_()
    skip.bias.zero_()
    pp = vae.cfg.patch_size ** 2
    for c in range(3):
        skip.weight[c * pp:(c + 1) * pp, c] = 1.0
    return vae


@torch.no_grad()
def fold_latent_stats(vae: CausalVAE, mean: torch.Tensor, std: torch.Tensor) -> CausalVAE:
    """Make the latent space unit-scale: afterwards `encode` returns (μ − mean)/std (and the
    log-variance of that), and `decode` expects such normalised latents, for per-channel
    `mean`, `std` `[z]` measured on the training data's latents. Folded exactly into the two
    1x1x1 convolutions around the latent (no new tensors, the weight format is unchanged):
    quant_conv's mean half W, b -> W/std, (b − mean)/std, its log-variance bias − 2 log std;
    post_quant_conv W, b -> W·diag(std), b + W·mean. Flow matching wants data at the noise's
    scale; the raw KL-light latents are several times larger. Changes `vae` in place."""
    z = vae.cfg.z_channels
    mean = mean.to(torch.float64).flatten()
    std = std.to(torch.float64).flatten()
    if mean.numel() != z or std.numel() != z or bool((std <= 0).any()):
        raise ValueError(f"latent stats must be {z} means and {z} positive stds")
    q, p = vae.quant_conv, vae.post_quant_conv
    w = q.weight.double()  # [2z, 2z, 1, 1, 1]
    b = q.bias.double()
    w[:z] /= std[:, None, None, None, None]
    b[:z] = (b[:z] - mean) / std
    b[z:] -= 2.0 * std.log()
    q.weight.copy_(w)
    q.bias.copy_(b)
    w = p.weight.double()  # [out, in, 1, 1, 1]
    p.bias.copy_(p.bias.double() + (w[:, :, 0, 0, 0] @ mean))
    p.weight.copy_(w * std[None, :, None, None, None])
    return vae
