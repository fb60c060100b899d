"""Regenerate a `liveavatar-dit` parity fixture with LiveAvatar's own streaming DiT.

    python tools/parity/make_liveavatar_dit.py --official CHECKOUT/LiveAvatar \
        --like tests/fixtures/golden/liveavatar-dit-b.safetensors --out /tmp/liveavatar-dit-b.safetensors

Builds `CausalWanModel_S2V(**config)` from `liveavatar/models/wan/causal_model_s2v.py`, draws its
weights by the fixture rule (`casual_audio_encoder.weights` = 1 + 0.2·N, as `weight_init` says),
and runs the streaming loop of `causal_s2v_pipeline.py:CausalS2VPipeline.generate` on the stored
inputs: for each clip r (`infer_frames` video frames, `blocks_per_clip` blocks), at r = 0 a sink
prefill (`sink_flag=True`, t = 0) into each of the 4 step caches, which share one sink (cond) cache
as the pipeline does without KV offload; then per block and per step i the model's forward with
step i's cache, `current_start` as the pipeline computes it, and diffusers'
`FlowMatchEulerDiscreteScheduler(1000, shift=3).set_timesteps(4)` step with its step index reset
per block (the pipeline sets it to the process rank, 0 here). The caches are sized as the pipeline
sizes them (one clip of tokens; 2800 sink tokens) with the model's heads and head width.

Shims (the official code needs CUDA, cuDNN or flash-attn and draws a random sink distance):
- S1 package `__init__` files skipped; `torch.compile` off (ENABLE_COMPILE=false);
- S2 `self.freqs ... .to("cuda")` in `__init__` removed (the table stays on the CPU);
- S3 the sink prefill's empty tensor has the model's width, not the hard-coded 5120;
- S4 cuDNN / flash attention replaced by fp32 `scaled_dot_product_attention`; every key-length
  mask the model passes is asserted to be full;
- S5 `random.randint(4, 30)` (the sink distance, drawn on every forward) pinned to
  `settings.sink_distance`;
- S7 the bf16 cast before `norm3` removed (a no-op in bf16 deployment; in an fp32 run a
  discontinuous rounding step), as `settings.precision_quirks.norm3` records.
Inputs: see `draw_inputs` (or `--stored-inputs`).
"""
from __future__ import annotations

import importlib.util
import os
import random
import sys

import torch
import torch.nn.functional as F

import _common as C

FAMILIES = ("liveavatar-dit",)  # the fixture families this script makes
SOURCES = ("Alibaba-Quark/LiveAvatar@9c2c38de1715e553127b42c82cb959f756b02595",)
MODULE = "liveavatar.models.wan.causal_model_s2v"
EDITS = (  # (shim, official text, replacement): each must occur exactly once
    ("S2", 'dim=1).to("cuda")', "dim=1)"),
    ("S3", "torch.zeros([1,5120,nf,height//2,width//2])", "torch.zeros([1,self.dim,nf,height//2,width//2])"),
    ("S7", "self.norm3(x.to(torch.bfloat16))", "self.norm3(x)"),
)


def sdpa(q, k, v, q_lens=None, k_lens=None, **_kw):
    """S4: [B, L, N, D] attention in fp32; the official call's masks must all be full."""
    if k_lens is not None:
        assert bool((torch.as_tensor(k_lens) == k.shape[1]).all()), "a key-length mask is not full"
    assert q_lens is None or bool((torch.as_tensor(q_lens) == q.shape[1]).all())
    out = F.scaled_dot_product_attention(q.float().transpose(1, 2), k.float().transpose(1, 2),
                                         v.float().transpose(1, 2))
    return out.transpose(1, 2).contiguous().type_as(q)


def import_model(root):
    os.environ["ENABLE_COMPILE"] = "false"
    C.skip_package_inits(root, "liveavatar")
    from liveavatar.models.wan.wan_2_2.modules import model as wan_model
    wan_model.flash_attention = sdpa
    path = root / "liveavatar/models/wan/causal_model_s2v.py"
    source = path.read_text()
    for shim, old, new in EDITS:
        if source.count(old) != 1:
            sys.exit(f"error: shim {shim}: {old!r} occurs {source.count(old)} times in {path}; "
                     "is the checkout at the commit SOURCES names?")
        source = source.replace(old, new)
    spec = importlib.util.spec_from_file_location(MODULE, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = mod
    exec(compile(source, str(path), "exec"), mod.__dict__)
    mod.attention = sdpa
    return mod


def new_caches(model, tokens, steps, dtype=torch.float32):
    n, d = model.num_heads, model.dim // model.num_heads
    shared = [{"cond_k": torch.zeros([1, 2800, n, d], dtype=dtype),
               "cond_v": torch.zeros([1, 2800, n, d], dtype=dtype),
               "cond_end": torch.tensor([0], dtype=torch.long)} for _ in range(model.num_layers)]
    caches = []
    for _ in range(steps):
        caches.append([{"k": torch.zeros([1, tokens, n, d], dtype=dtype),
                        "v": torch.zeros([1, tokens, n, d], dtype=dtype), **shared[layer]}
                       for layer in range(model.num_layers)])
    cross = [{"k": torch.zeros([1, 0, n, d]), "v": torch.zeros([1, 0, n, d]), "is_init": False}
             for _ in range(model.num_layers)]
    return caches, cross


def draw_inputs(settings, like):
    """N(0,1) from one generator seeded with `inputs_seed`: the reference latent, the motion
    latents, the text context, the audio features, then each clip's noise ([16, frames of a clip,
    H, W], as the pipeline draws a clip at once) cut into blocks. The text length and the audio
    length are read from the `--like` file's shapes; every value is drawn."""
    gen = torch.Generator().manual_seed(settings["weight_init"]["inputs_seed"])
    h, w, fpb = settings["latent_height"], settings["latent_width"], settings["frames_per_block"]
    per_clip = settings.get("blocks_per_clip", settings["num_blocks"])
    out = {"ref_latents": torch.randn((1, 16, 1, h, w), generator=gen),
           "motion_latents": torch.randn((1, 16, settings["motion_frames"][1], h, w), generator=gen),
           "context": torch.randn(like["inputs.context"].shape, generator=gen),
           "audio": torch.randn(like["inputs.audio"].shape, generator=gen)}
    blocks = []
    for _clip in range(settings["num_blocks"] // per_clip):
        clip = torch.randn((16, per_clip * fpb, h, w), generator=gen)
        blocks += [clip[:, j * fpb:(j + 1) * fpb] for j in range(per_clip)]
    out["noise"] = torch.stack(blocks)
    return out


def main():
    ap = C.parser(__doc__)
    ap.add_argument("--stored-inputs", action="store_true",
                    help="take the inputs from the --like file instead of drawing them (the shipped "
                         "-a file's noise was drawn in an order this script does not know)")
    args = ap.parse_args()
    root = C.check_checkout(args.official, "liveavatar/models/wan/causal_model_s2v.py")
    C.cpu_fp32()
    meta, config, settings, like = C.read_fixture(args.like)
    mod = import_model(root)
    from diffusers import FlowMatchEulerDiscreteScheduler

    model = mod.CausalWanModel_S2V(**config).eval()
    init = settings["weight_init"]
    C.draw_weights(model, init["weights_seed"],
                   {"casual_audio_encoder.weights": lambda z: 1 + 0.2 * z})
    fpb, steps = settings["frames_per_block"], settings["steps"]
    per_clip = settings.get("blocks_per_clip", settings["num_blocks"])  # -a: all blocks in one clip
    infer_frames = settings.get("infer_frames", per_clip * fpb * 4)
    fsl = settings["tokens_per_frame"]
    h, w = settings["latent_height"], settings["latent_width"]
    inputs = C.group(like, "inputs") if args.stored_inputs else draw_inputs(settings, like)
    ref, motion, context = inputs["ref_latents"], inputs["motion_latents"], inputs["context"]
    audio, noise = inputs["audio"], inputs["noise"]
    caches, cross = new_caches(model, settings["kv_ring_frames"] * fsl, steps)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=settings["shift"])
    scheduler.set_timesteps(steps)
    pose = torch.zeros([1, 16, fpb, h, w])
    base = {"context": [context], "seq_len": None, "cond_states": pose, "motion_latents": motion,
            "ref_latents": ref, "motion_frames": settings["motion_frames"],
            "drop_motion_frames": False}

    real_randint = random.randint
    random.randint = lambda a, b: settings["sink_distance"]  # S5
    latents, velocity = [], None
    try:
        with torch.no_grad():
            for r in range(settings["num_blocks"] // per_clip):
                clip_audio = audio[..., r * infer_frames:(r + 1) * infer_frames]
                if r == 0:
                    for cache in caches:  # one prefill per step cache, as the pipeline does
                        model([noise[0]], t=torch.zeros([1, fpb]), **base,
                              audio_input=clip_audio[..., :fpb * 4], sink_flag=True,
                              kv_cache=cache, crossattn_cache=cross,
                              current_start=0, current_end=fpb * fsl)
                for j in range(per_clip):
                    x = noise[r * per_clip + j]
                    scheduler._step_index, scheduler._begin_index = 0, 0
                    start = (j + r * per_clip) * fpb * fsl
                    for i, t in enumerate(scheduler.timesteps):
                        out = model([x], t=torch.tensor([t] * fpb).unsqueeze(0), **base,
                                    audio_input=clip_audio[..., j * fpb * 4:(j + 1) * fpb * 4],
                                    kv_cache=caches[i], crossattn_cache=cross,
                                    current_start=start, current_end=start + fpb * fsl, mask=None)
                        v = torch.cat(out, dim=0)
                        velocity = v.clone() if velocity is None else velocity
                        x = scheduler.step(v.unsqueeze(0), t, x.unsqueeze(0),
                                           return_dict=False)[0].squeeze(0)
                    latents.append(x)
    finally:
        random.randint = real_randint
    report = C.write_and_compare(args.out, meta, like, model.state_dict(), inputs,
                                 {"latents": torch.stack(latents), "velocity_block0_step0": velocity})
    C.finish(report)


if __name__ == "__main__":
    main()
