"""Time our FlashHead Pro chunk against SoulX-FlashHead's own loop, side by side in one process.

    python tools/parity/time_flashhead.py --official CHECKOUT/SoulX-FlashHead [--chunks 8]
        [--threads 1] [--seed 0] [--reduced | --folder DIR] [--official-compile] [--plain-norm]

Both sides load the same random folder in the official layout: the tiny one (`models tiny
flashhead-pro`: `write_official_folder`; dispatch-bound), `--reduced` (a width-384 DiT and the Wan
VAE's real layout at width 16, 128 px: compute-bound), or `--folder DIR`. Ours through our
loader (`load_flashhead`), theirs through the official classes (`WanModelAudioProject` with the
tiny audio sizes, as make_flashhead_dit.py builds it; `WanVAE` over `WanVAE_` at the folder's
narrow config; `flash_head/audio_analysis`'s `Wav2Vec2Model` read from the folder's wav2vec2).
Then, chunk after chunk on the same speech and the same noise draws (the official generator's, replayed into our denoise stage):
- official: the stream mode of `generate_video.py` (the 8 s deque, `get_audio_embedding`,
  `run_pipeline`: 4 steps, whole decode, colour correction at strength 1, motion re-encode);
- ours: the engine's chunk loop for the folder (`ChunkLoop`, the FlashHead stages), frames to a
  recording publisher (no sinks, no watermark: the official loop has neither).
The two alternate chunk by chunk (official k, ours k), so drift of the machine hits both alike.
Per chunk: wall time, and the stages (audio window, denoise, decode, colour correction, motion
re-encode) timed by wrapping the callables each side calls. Outputs must agree: the chunk's
decoded latents within the flashhead-dit bound (1e-5 · max(1, max|latents|)) and the published
frames within 1 grey level. Prints one JSON line (the last line of stdout).

The official constructor wraps its DiT and VAE in `torch.compile`; `--official-compile` does the
same here (default: eager, the loop as the fixtures run it). `--plain-norm` runs ours with the Wan
VAE's RMS norm through `F.normalize`, as before the fast norm (models/wan/vae_blocks.py). Run
with the official code's dependencies (diffusers, einops, loguru, transformers) importable;
shims: `_flashhead.py`.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

import _common as C
import _flashhead as FH
from make_flashhead_dit import build_model

SOURCES = ("Soul-AILab/SoulX-FlashHead@12467cef31a9554cd9682a0521e6e87deaef9810",)
STAGES = ("audio", "denoise", "decode", "color", "encode")


class Timers:
    """Seconds per stage name, for the chunk being timed."""

    def __init__(self) -> None:
        self.s: dict[str, float] = defaultdict(float)

    def wrap(self, name, fn, record=None):
        def timed(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            self.s[name] += time.perf_counter() - t0
            if record is not None:
                record(a, out)
            return out
        return timed

    def take(self) -> dict[str, float]:
        out, self.s = dict(self.s), defaultdict(float)
        return out


def load_official_utils(root):
    """flash_head/utils/utils.py itself (colour correction), with its unused imports stood in."""
    for name in ("torchvision", "pyloudnorm"):
        try:
            importlib.import_module(name)
        except ImportError:
            C.stub_module(name, transforms=C.stub_module(name + ".transforms"))
    spec = importlib.util.spec_from_file_location("fh_utils_real", root / "flash_head/utils/utils.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def official_side(root, folder, picture, timers, compile_official):
    """The official pipeline object on the folder's weights, reference prepared."""
    from safetensors.torch import load_file
    from transformers import Wav2Vec2FeatureExtractor

    model_mod, pipe_mod, inf_mod = FH.import_flashhead(root)
    from flash_head.audio_analysis.wav2vec2 import Wav2Vec2Model
    from flash_head.wan.modules import vae as vae_mod

    raw = json.loads((folder / "Model_Pro/config.json").read_text())
    state = load_file(str(folder / "Model_Pro/diffusion_pytorch_model.safetensors"))
    w2v_cfg = json.loads((folder / "wav2vec2-base-960h/config.json").read_text())
    dim = raw["dim"]
    tiny = {"blocks": w2v_cfg["num_hidden_layers"], "channels": w2v_cfg["hidden_size"],
            "intermediate_dim": state["audio_proj.proj1.weight"].shape[0], "output_dim": dim,
            "context_tokens": state["audio_proj.proj3.weight"].shape[0] // dim,
            "audio_emb_mlp_in_dim": state["audio_emb.proj.0.weight"].shape[1]}
    kwargs = {k: v for k, v in raw.items() if not k.startswith("_")}
    kwargs.setdefault("text_dim", state["text_embedding.0.weight"].shape[1])  # the tiny folder
    kwargs.setdefault("has_image_input", False)  # leaves out what the release's config has
    model = build_model(model_mod, kwargs, tiny)
    unused = ("text_embedding.", "audio_emb.")  # never read by the forward; the tiny folder's are stand-ins
    missing, unexpected = model.load_state_dict({k: v for k, v in state.items() if not k.startswith(unused)},
                                                strict=False)
    if unexpected or any(not k.startswith(unused) for k in missing):
        sys.exit(f"error: the official DiT does not take the folder's weights: {missing} {unexpected}")

    vae_cfg = json.loads((folder / "avatarstream.json").read_text())["wan_vae"]
    real_video_vae = vae_mod._video_vae
    vae_mod._video_vae = lambda pretrained_path=None, z_dim=None, **kw: real_video_vae(
        pretrained_path, z_dim=z_dim, **{**kw, **{k: v for k, v in vae_cfg.items() if k != "z_dim"}})
    try:
        vae = vae_mod.WanVAE(vae_path=str(folder / "VAE_Wan/Wan2.1_VAE.pth"), dtype=torch.float32, device="cpu")
    finally:
        vae_mod._video_vae = real_video_vae

    pipe = FH.bare_pipeline(pipe_mod)
    pipe.model_type, pipe.model, pipe.config, pipe.vae = "pro", model, model.config, vae
    pipe.audio_encoder = Wav2Vec2Model.from_pretrained(str(folder / "wav2vec2-base-960h"),
                                                       attn_implementation="sdpa").eval()
    pipe.wav2vec_feature_extractor = Wav2Vec2FeatureExtractor(
        feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True, return_attention_mask=False)
    if compile_official:  # what FlashHeadPipeline.__init__ does (COMPILE_MODEL, COMPILE_VAE)
        pipe.model = torch.compile(pipe.model)
        vae.encode, vae.decode = torch.compile(vae.encode), torch.compile(vae.decode)
    params = inf_mod.get_infer_params()
    pipe.frame_num = params["frame_num"]
    pipe.motion_frames_num = (params["motion_frames_latent_num"] - 1) * model.config.vae_stride[0] + 1
    pipe.color_correction_strength = params["color_correction_strength"]
    h, w = picture.shape[-2:]
    pipe.lat_h, pipe.lat_w = h // model.config.vae_stride[1], w // model.config.vae_stride[2]
    pipe.generator = torch.Generator().manual_seed(42)
    pipe.timesteps = [pipe_mod.timestep_transform(torch.tensor([t]), shift=params["sample_shift"])
                      for t in (1000.0, 750.0, 500.0, 250.0, 0.0)]
    utils = load_official_utils(root)

    t0 = time.perf_counter()
    with torch.no_grad():  # prepare_params without the image file: the same tensors
        cond = (picture.permute(1, 0, 2, 3)[None].float() / 255 - 0.5) * 2  # [1, 3, 1, H, W]
        pipe.cond_image_dict = {"ref": None}
        pipe.cond_image_tensor_dict = {"ref": cond}
        pipe.ref_img_latent_dict = {"ref": vae.encode(cond.repeat(1, 1, pipe.frame_num, 1, 1))}
        pipe.reset_person_name("ref")
    reference_s = time.perf_counter() - t0

    draws = []
    pipe_mod.match_and_blend_colors_torch = timers.wrap("color", utils.match_and_blend_colors_torch)
    real_forward = pipe.model.forward
    pipe.model.forward = timers.wrap("denoise", real_forward)
    latents = []
    vae.decode = timers.wrap("decode", vae.decode, lambda a, out: latents.append(a[0].clone()))
    vae.encode = timers.wrap("encode", vae.encode)
    real_embedding = inf_mod.get_audio_embedding
    audio_embedding = timers.wrap("audio", real_embedding)

    cached = params["sample_rate"] * params["cached_audio_duration"]
    end = params["cached_audio_duration"] * params["tgt_fps"]
    from collections import deque
    dq = deque([0.0] * cached, maxlen=cached)

    def chunk(samples: np.ndarray):
        """One iteration of generate_video.py's stream loop -> (frames [N, H, W, 3] in [0, 255],
        latents decoded, noise draws)."""
        draws.clear()
        real_randn = torch.randn

        def recording_randn(*a, **k):
            out = real_randn(*a, **k)
            draws.append(out.clone())
            return out

        torch.randn = recording_randn
        try:
            dq.extend(samples.tolist())
            emb = audio_embedding(pipe, np.array(dq), end - pipe.frame_num, end)
            video = inf_mod.run_pipeline(pipe, emb)[pipe.motion_frames_num:]
        finally:
            torch.randn = real_randn
        return video, latents.pop(), list(draws)

    return chunk, reference_s


REDUCED = {"dim": 384, "depth": 4, "heads": 4, "ffn_dim": 1536, "size": 128,
           "wan_vae": {"dim": 16, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2}}


def write_reduced(root: Path, seed: int) -> Path:
    """The tiny folder with a wider DiT and the Wan VAE's real layout at 1/6 of its width, at
    `REDUCED["size"]` pixels (the tiny wav2vec2 stays): compute, not dispatch, dominates."""
    from dataclasses import replace

    from safetensors.torch import save_file

    from avatarstream.models.flashhead import FlashHeadConfig, FlashHeadDiT
    from avatarstream.models.wan.vae import WanVAE, WanVAEConfig
    from avatarstream.weights.flashhead_folder import random_state, write_official_folder

    write_official_folder(root, "pro", seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    cfg_path = root / "Model_Pro/config.json"
    raw = json.loads(cfg_path.read_text())
    old = json.loads((root / "wav2vec2-base-960h/config.json").read_text())
    tiny = FlashHeadConfig.from_official(raw, {"blocks": old["num_hidden_layers"], "channels": old["hidden_size"],
                                               "intermediate_dim": 32, "context_tokens": 4, "output_dim": raw["dim"]})
    cfg = replace(tiny, dim=REDUCED["dim"], depth=REDUCED["depth"], heads=REDUCED["heads"], ffn_dim=REDUCED["ffn_dim"])
    state = {k.replace(".audio_attn.", ".cross_attn.").replace(".norm_audio.", ".norm3."): v
             for k, v in random_state(FlashHeadDiT(cfg), g).items()}
    d = cfg.dim
    state.update({"text_embedding.0.weight": torch.randn(d, 32, generator=g), "text_embedding.0.bias": torch.zeros(d),
                  "text_embedding.2.weight": torch.randn(d, d, generator=g), "text_embedding.2.bias": torch.zeros(d),
                  "audio_emb.proj.0.weight": torch.randn(d, 16, generator=g)})
    save_file(state, str(root / "Model_Pro/diffusion_pytorch_model.safetensors"))
    raw.update(dim=d, num_layers=cfg.depth, num_heads=cfg.heads, ffn_dim=cfg.ffn_dim)
    cfg_path.write_text(json.dumps(raw, indent=1))
    torch.save(random_state(WanVAE(WanVAEConfig.from_official(REDUCED["wan_vae"])), g),
               str(root / "VAE_Wan/Wan2.1_VAE.pth"))
    (root / "avatarstream.json").write_text(json.dumps({"size": REDUCED["size"], "wan_vae": REDUCED["wan_vae"]}))
    return root


class RecordingPublisher:
    """What the chunk loop publishes, kept in memory (no sinks, no background thread)."""

    first_frame_time = None

    def __init__(self) -> None:
        self.video: list[np.ndarray] = []

    def put_video(self, frames, start, fps):  # noqa: ANN001
        self.video.append(frames)

    def put_audio(self, *a) -> None:  # noqa: ANN002
        pass

    def raise_if_failed(self) -> None:
        pass


def our_side(folder, picture, wave, timers, plain_norm):
    from avatarstream.engine.loop import ChunkLoop
    from avatarstream.engine.session import SessionState
    from avatarstream.engine.stages import whole_decode
    from avatarstream.engine.stages.flashhead import flashhead_reference, flashhead_stages
    from avatarstream.weights.flashhead_folder import load_flashhead, parse_name

    name = f"flashhead-pro:{folder}"
    models = load_flashhead(parse_name(name), name, device="cpu", bf16=False)
    if plain_norm:  # the Wan VAE's RMS norm as the official code computes it (F.normalize)
        import torch.nn.functional as F

        from avatarstream.models.wan.vae_blocks import RMSNorm
        RMSNorm.forward = lambda self, x: F.normalize(x, dim=1) * self.scale * self.gamma
    c = models.config
    t0 = time.perf_counter()
    state = SessionState(publisher=RecordingPublisher())
    with torch.inference_mode():
        flashhead_reference(models, c).run(state, picture)
    reference_s = time.perf_counter() - t0
    stages = flashhead_stages(models, c)
    audio_stage, denoise_stage, decode_stage = stages
    pending: list[list[torch.Tensor]] = []
    denoise_stage.draws = lambda plan, i: pending[0][i]
    whole_decode.match_colors = timers.wrap("color", whole_decode.match_colors)
    vae = models.vae.model
    latents = []
    vae.decode = timers.wrap("decode", vae.decode, lambda a, out: latents.append(a[0].clone()))
    vae.encode = timers.wrap("encode", vae.encode)
    loop = ChunkLoop(models, state, iter(wave.split(16000)), config=c)

    def chunk(draws):
        pending[:] = [draws]
        t0 = time.perf_counter()
        rec = loop.plan()
        timers.s["context"] += time.perf_counter() - t0
        for stage, label in zip(stages, ("audio", "denoise", "publish")):
            t0 = time.perf_counter()
            stage([(rec, state)])
            timers.s[label] += time.perf_counter() - t0
        loop.finish(rec)
        return state.publisher.video.pop(), latents.pop()

    return chunk, reference_s, (audio_stage, denoise_stage, decode_stage)


def main():
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--official", required=True, type=Path, help="root of a SoulX-FlashHead checkout")
    ap.add_argument("--folder", type=Path, help="a FlashHead folder (default: a tiny random one)")
    ap.add_argument("--reduced", action="store_true", help="a wider random folder (REDUCED) instead of the tiny one")
    ap.add_argument("--chunks", type=int, default=8, help="chunks timed per side (after one warm-up)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="weights seed of the tiny folder")
    ap.add_argument("--official-compile", action="store_true", help="torch.compile theirs, as their constructor does")
    ap.add_argument("--plain-norm", action="store_true",
                    help="our Wan VAE's RMS norm through F.normalize, as before the fast norm (for before/after)")
    args = ap.parse_args()
    root = C.check_checkout(args.official, "flash_head/src/pipeline/flash_head_pipeline.py")
    C.cpu_fp32()
    torch.set_num_threads(args.threads)
    with contextlib.ExitStack() as stack:
        folder = args.folder
        if folder is None:
            from avatarstream.weights.flashhead_folder import write_official_folder
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "fh"
            folder = write_reduced(tmp, args.seed) if args.reduced else write_official_folder(tmp, "pro", seed=args.seed)
        size = json.loads((folder / "avatarstream.json").read_text()).get("size", 512)
        g = torch.Generator().manual_seed(1)
        picture = (torch.rand(1, 3, size, size, generator=g) * 255).round().to(torch.uint8)
        slice_len = 28 * 640
        wave = 0.3 * torch.randn((args.chunks + 3) * slice_len, generator=g)
        theirs_t, ours_t = Timers(), Timers()
        theirs, ref_theirs = official_side(root, folder, picture, theirs_t, args.official_compile)
        ours, ref_ours, _stages = our_side(folder, picture, wave, ours_t, args.plain_norm)

        rows, worst_lat, worst_px = [], 0.0, 0.0
        for k in range(args.chunks + 1):  # chunk 0 warms both up and is not counted
            samples = wave[k * slice_len:(k + 1) * slice_len].numpy()
            t0 = time.perf_counter()
            video_o, lat_o, draws = theirs(samples)
            t_o = time.perf_counter() - t0
            t0 = time.perf_counter()
            video_s, lat_s = ours([d[None] for d in draws])
            t_s = time.perf_counter() - t0
            d_lat = (lat_o[None] - lat_s.float()).abs().max().item()
            bound = 1e-5 * max(1.0, lat_o.abs().max().item())
            d_px = float(np.abs(video_o.numpy() - video_s.astype(np.float32)).max())
            if d_lat > bound or d_px > 1.0:
                sys.exit(f"error: chunk {k}: outputs disagree (latents {d_lat:.3g} > {bound:.3g} "
                         f"or frames {d_px:.3g} > 1 grey level)")
            worst_lat, worst_px = max(worst_lat, d_lat), max(worst_px, d_px)
            rows.append((t_o, t_s, theirs_t.take(), ours_t.take()))
        steady = rows[1:]
        med_o = statistics.median(r[0] for r in steady)
        med_s = statistics.median(r[1] for r in steady)

        def profile(idx):
            keys = sorted({k for r in steady for k in r[idx]})
            return {k: round(1000 * statistics.median(r[idx].get(k, 0.0) for r in steady), 2) for k in keys}

        report = {
            "folder": str(args.folder or ("reduced" if args.reduced else "tiny")), "size": size, "threads": args.threads,
            "chunks_timed": len(steady), "official_compiled": args.official_compile,
            "ours_rms_norm": "F.normalize" if args.plain_norm else "fast",
            "chunk_ms": {"official": round(1000 * med_o, 2), "ours": round(1000 * med_s, 2)},
            "ratio_official_over_ours": round(med_o / med_s, 3),
            "first_chunk_ms": {"official": round(1000 * rows[0][0], 1), "ours": round(1000 * rows[0][1], 1)},
            "reference_ms": {"official": round(1000 * ref_theirs, 1), "ours": round(1000 * ref_ours, 1)},
            "profile_ms": {"official": profile(2), "ours": profile(3)},
            "parity": {"latents_max_abs_diff": worst_lat, "frames_max_grey_diff": worst_px},
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
