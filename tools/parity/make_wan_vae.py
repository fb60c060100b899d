"""Regenerate a `wan-vae` parity fixture with the official Wan2.1 VAE (LiveAvatar's streaming copy).

    python tools/parity/make_wan_vae.py --official CHECKOUT/LiveAvatar \
        --like tests/fixtures/golden/wan-vae-b.safetensors --out /tmp/wan-vae-b.safetensors \
        [--wan21 CHECKOUT/Wan2.1]

Runs `WanVAE_` from `liveavatar/models/wan/wan_2_2/modules/vae_streaming.py` at the fixture's
`config`: the whole decode, `stream_decode` once per latent (cache kept between calls) and the
encoder mean. With `--wan21`, upstream `wan/modules/vae.py:WanVAE_` runs on the same weights and
inputs and its differences are reported (`cross_check`). Inputs: one generator seeded with
`inputs_seed` draws the normalised latents (N(0,1)) and then the video (uniform in [-1, 1]).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

import _common as C

FAMILIES = ("wan-vae",)  # the fixture families this script makes
SOURCES = (
    "Alibaba-Quark/LiveAvatar@9c2c38de1715e553127b42c82cb959f756b02595",
    "Wan-Video/Wan2.1@9737cba9c1c3c4d04b33fcad41c111989865d315",
)


def load_liveavatar_vae(root):
    os.environ["ENABLE_COMPILE"] = "false"  # inference_utils wraps stream_decode in torch.compile
    C.skip_package_inits(root, "liveavatar")
    from liveavatar.models.wan.wan_2_2.modules import vae_streaming
    return vae_streaming.WanVAE_


def load_wan21_vae(root):
    import importlib.util
    spec = importlib.util.spec_from_file_location("wan21_vae", root / "wan/modules/vae.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.WanVAE_


def run(model, latents, video, scale):
    with torch.no_grad():
        whole = model.decode(latents[None], scale)[0]
        stream = None
        if hasattr(model, "stream_decode"):
            model.first_decode = True
            parts = [model.stream_decode(latents[None, :, i:i + 1], scale)[0]
                     for i in range(latents.shape[1])]
            stream = torch.cat(parts, dim=1)
        encoded = model.encode(video[None], scale)[0]
    return whole, stream, encoded


def main():
    ap = C.parser(__doc__)
    ap.add_argument("--wan21", type=Path, help="a Wan2.1 checkout, to cross-check upstream's VAE")
    args = ap.parse_args()
    root = C.check_checkout(args.official, "liveavatar/models/wan/wan_2_2/modules/vae_streaming.py")
    C.cpu_fp32()
    meta, config, settings, like = C.read_fixture(args.like)
    model = load_liveavatar_vae(root)(**config).eval()
    init = settings["weight_init"]
    C.draw_weights(model, init["weights_seed"])

    c, t, h, w = (settings["latent_channels"], settings["latent_frames"],
                  settings["latent_height"], settings["latent_width"])
    gen = torch.Generator().manual_seed(init["inputs_seed"])
    latents = torch.randn((c, t, h, w), generator=gen)
    video = torch.rand((3, 1 + 4 * (t - 1), 8 * h, 8 * w), generator=gen) * 2 - 1
    scale = [torch.tensor(settings["latent_mean"]), 1.0 / torch.tensor(settings["latent_std"])]
    whole, stream, encoded = run(model, latents, video, scale)

    update = {}
    if args.wan21:
        up = load_wan21_vae(C.check_checkout(args.wan21, "wan/modules/vae.py"))(**config).eval()
        up.load_state_dict(model.state_dict())
        u_whole, _, u_enc = run(up, latents, video, scale)
        update["cross_check_wan21_max_abs_diff"] = {
            "decode": (u_whole - whole).abs().max().item(),
            "encode": (u_enc - encoded).abs().max().item()}
    report = C.write_and_compare(
        args.out, meta, like, model.state_dict(), {"latents": latents, "video": video},
        {"decoded_whole": whole, "decoded_stream": stream, "encoded": encoded})
    if update:
        report["cross_check"] = update["cross_check_wan21_max_abs_diff"]
    C.finish(report)


if __name__ == "__main__":
    main()
