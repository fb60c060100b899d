"""Regenerate a `flashhead-dit` parity fixture (Pro or Lite) with SoulX-FlashHead's own loop.

    python tools/parity/make_flashhead_dit.py --official CHECKOUT/SoulX-FlashHead \
        --like tests/fixtures/golden/flashhead-dit-b.safetensors --out /tmp/flashhead-dit-b.safetensors

Builds `WanModelAudioProject(**config)` from `flash_head/src/modules/flash_head_model.py` with the
audio projector's hard-coded wav2vec2-base sizes (12 layers, 768 channels, 512 intermediate,
output 1536, 32 tokens, `MLP(768, dim)`) replaced by `settings.audio_tiny_overrides`, draws its
weights by the fixture rule, and runs `FlashHeadPipeline.generate` from
`flash_head/src/pipeline/flash_head_pipeline.py` chunk after chunk on a pipeline object made
without its constructor: fp32 on the CPU, the timesteps `prepare_params` computes for
`settings.steps` with shift 5, an identity VAE (decode(z) = z, encode(v) = v, so the motion
hand-off is the last 2 latents), colour correction off. The noise comes from the pipeline's own
generator seeded with `noise_generator_seed`; every draw is recorded into `inputs.noise`.
`inputs.y` and `inputs.audio` are drawn N(0,1), in that order, from a generator seeded with
`inputs_seed`. Shims: `_flashhead.py`.
"""
from __future__ import annotations

import torch

import _common as C
import _flashhead as FH

FAMILIES = ("flashhead-dit",)  # the fixture families this script makes
SOURCES = ("Soul-AILab/SoulX-FlashHead@12467cef31a9554cd9682a0521e6e87deaef9810",)


class IdentityVAE:
    """Stands in for the Wan / LTX VAE: the fixture tests the DiT, the sampler and the hand-off."""

    def decode(self, z):
        return z.unsqueeze(0)  # [1, C, F, H, W], as the real decode's batch of one video

    def encode(self, video):
        return video[0]


def build_model(model_mod, config, tiny):
    real_proj, real_mlp = model_mod.AudioProjModel, model_mod.MLP

    def tiny_proj(**kw):
        kw.update(blocks=tiny["blocks"], channels=tiny["channels"],
                  intermediate_dim=tiny["intermediate_dim"], output_dim=tiny["output_dim"],
                  context_tokens=tiny["context_tokens"])
        return real_proj(**kw)

    def tiny_mlp(in_dim, out_dim):
        return real_mlp(tiny["audio_emb_mlp_in_dim"] if in_dim == 768 else in_dim, out_dim)

    model_mod.AudioProjModel, model_mod.MLP = tiny_proj, tiny_mlp
    try:
        return model_mod.WanModelAudioProject(**config).eval()
    finally:
        model_mod.AudioProjModel, model_mod.MLP = real_proj, real_mlp


def main():
    args = C.parser(__doc__).parse_args()
    root = C.check_checkout(args.official, "flash_head/src/pipeline/flash_head_pipeline.py")
    C.cpu_fp32()
    meta, config, settings, like = C.read_fixture(args.like)
    model_mod, pipe_mod, _inf = FH.import_flashhead(root)
    model = build_model(model_mod, config, settings["audio_tiny_overrides"])
    init = settings["weight_init"]
    C.draw_weights(model, init["weights_seed"])

    c, f, h, w = (settings["latent_channels"], settings["latent_frames"],
                  settings["latent_height"], settings["latent_width"])
    tiny = settings["audio_tiny_overrides"]
    gen = torch.Generator().manual_seed(init["inputs_seed"])
    y = torch.randn((c, f, h, w), generator=gen)
    audio = torch.randn((settings["chunks"], settings["frame_num"], settings["audio_window"],
                         tiny["blocks"], tiny["channels"]), generator=gen)

    pipe = FH.bare_pipeline(pipe_mod)
    pipe.model, pipe.config, pipe.vae = model, model.config, IdentityVAE()
    pipe.model_type = settings["variant"]
    pipe.frame_num = settings["frame_num"]
    pipe.motion_frames_num = settings["motion_latents"]  # identity VAE: frames are latents
    pipe.color_correction_strength = 0.0
    pipe.lat_h, pipe.lat_w = h, w
    pipe.generator = torch.Generator().manual_seed(init["noise_generator_seed"])
    unshifted = settings["timesteps_unshifted"]
    pipe.timesteps = [pipe_mod.timestep_transform(torch.tensor([t]), shift=settings["shift"])
                      for t in unshifted]
    pipe.ref_img_latent = y
    pipe.latent_motion_frames = y[:, :1].clone()  # what reset_person_name sets

    draws, velocities = [], []
    real_randn, real_forward = torch.randn, model.forward

    def recording_randn(*a, **k):
        out = real_randn(*a, **k)
        draws.append(out.clone())
        return out

    def recording_forward(*a, **k):
        out = real_forward(*a, **k)
        velocities.append(out[0].clone())
        return out

    latents, noise = [], []
    model.forward = recording_forward
    torch.randn = recording_randn
    try:
        for chunk in range(settings["chunks"]):
            draws.clear()
            # identity VAE: generate() returns the chunk's final x, after the motion overwrite
            latents.append(pipe.generate(audio[chunk][None]))
            noise.append(torch.stack(draws))
    finally:
        torch.randn = real_randn
        model.forward = real_forward
    report = C.write_and_compare(
        args.out, meta, like, model.state_dict(),
        {"y": y, "audio": audio, "noise": torch.stack(noise)},
        {"latents": torch.stack(latents), "velocity_chunk0_step0": velocities[0]})
    C.finish(report)


if __name__ == "__main__":
    main()
