"""`avatarstream eval benchmark`: run a model (or a baseline) on held-out synthetic cases and score it.

A case is two clips of one identity from `clip_specs` of the split (seed = --seed): clip 0 gives
the driving audio and the ground-truth render, clip 1 (another scene, other sentences) is the
reference video — the cross-scene setup of Avatar V §7.1. `--seed` re-draws identities, voices,
scenes and sentences. Models:
- `ground-truth`: the renders themselves (the level a model is held to);
- `static-frame`: the reference's first frame held still for the length of the audio;
- `wrong-identity`: the ground truth's exact face states (mouth track, head motion, blinks: made
  from the target's speech *and* its talking style, so they cannot be re-drawn for another person)
  rendered on another held-out person in the same scene: ground-truth sync on the wrong face;
- `vae-roundtrip:NAME`: the ground truth encoded and decoded by registry model NAME's VAE, the
  ceiling of anything that model's generator can show (its decoder makes every output pixel).
  `latent_noise` A > 0 decodes the latents plus A × their per-channel std of Gaussian noise
  (seeded by `--seed`): how the decoder treats latents that are off by a generator's error (a DiT
  that predicts unit-scale latents with RMS error e is A = e);
- any registry model: `Pipeline(load_model(name)).run(reference, audio chunks, [sink])`, with FPS
  and time-to-first-frame from the run (Live Avatar §10 definitions). `reference_mode="frame"`
  gives the model only the reference's first frame; FaceSim and style error are still measured
  against the reference video, so both modes are scored against the same thing. `steps`
  overrides the model's denoising steps.

`Bench` holds the cases of one split and what every run on them shares (renders, the reference's
reads, the ground truth's evaluation), so `eval card` and `eval sweep` compute each once.
`Bench.score` adds `mouth_track_r`, which needs what only a synthetic case has: the correlation of
the opening the face-state expert reads with the renderer's exact opening of the driving clip.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from avatarstream.data import Clip, ClipSpec, DatasetConfig, clip_specs
from avatarstream.data.splits import check_split, derive_seed, identity_seeds
from avatarstream.engine.schedule import STRATEGIES
from avatarstream.errors import ConfigError, InputError
from avatarstream.eval.experts import Experts, load_experts
from avatarstream.eval.metrics import Evaluation, evaluate, reference_embedding
from avatarstream.eval.report import frame_strip, plot_case, write_report
from avatarstream.media.frames import AudioChunk, VideoChunk

BASELINES = ("ground-truth", "static-frame", "wrong-identity")
REFERENCE_MODES = ("video", "frame")
MAX_STEPS = 64
NOMINAL_CHUNK = 32  # frames: seams assumed for baselines, which have no chunks of their own
SUMMARY_KEYS = ("sync_c", "sync_d", "face_sim", "style_error", "silence_mouth_closed", "mouth_track_r",
                "boundary_smoothness", "latent_cadence", "seam_vs_cadence", "psnr", "ssim", "fps", "ttff_s")
STILL_MOUTH = 1e-3  # std of the read opening (0..1) below which a mouth does not move: no correlation


class CollectSink:
    """In-process sink keeping every published frame and the start frame of each chunk."""

    def __init__(self) -> None:
        self.frames: list[np.ndarray] = []
        self.chunk_starts: list[int] = []
        self.durable_frames = 0

    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None:
        self.fps = fps

    def write_video(self, chunk: VideoChunk) -> None:
        self.chunk_starts.append(int(chunk.start_frame))
        self.frames.extend(np.asarray(chunk.frames))
        self.durable_frames += int(chunk.frames.shape[0])

    def write_audio(self, chunk: AudioChunk) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


@dataclass
class Generated:
    """frames [F, H, W, 3] uint8; chunk_starts; fps / ttff_s of the run (None for baselines)."""

    frames: np.ndarray
    chunk_starts: list[int]
    fps: float | None = None
    ttff_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def mouth_track_r(opening: np.ndarray, truth: np.ndarray) -> float | None:
    """Pearson correlation of the mouth opening the face-state expert reads in the generated video
    (`states[:, 7]`) with the renderer's exact opening of the driving clip, over the common frames:
    whether the mouth follows this speech, not only whether it moves. None when either track stands
    still (a static frame), where a correlation is undefined."""
    n = min(len(opening), len(truth))
    a, b = np.asarray(opening[:n], np.float64), np.asarray(truth[:n], np.float64)
    if n < 3 or a.std() < STILL_MOUTH or b.std() < STILL_MOUTH:
        return None
    return float(np.corrcoef(a, b)[0, 1])


def wrong_identity_for(identity: int, seed: int) -> int:
    """A held-out identity other than `identity`, drawn from (seed, identity): the person the
    wrong-identity baseline shows. Held out whatever the split, so no model has trained on it."""
    for s in identity_seeds(derive_seed("wrong-identity", seed, identity), 2, "heldout-identity"):
        if s != identity:
            return s
    raise AssertionError("identity_seeds returned two equal seeds")  # distinct by contract


def render_wrong_identity(clip: Clip, identity: int) -> np.ndarray:
    """The clip's exact per-frame face states rendered on person `identity` in the clip's scene ->
    [F, S, S, 3] uint8. Mouth and motion tracks depend on the speaker's talking style (amplitude,
    sharpness, sway, blink rate), so they are transplanted as states, not re-drawn from a seed."""
    from avatarstream.data.identity import Identity
    from avatarstream.data.render import AvatarRenderer

    return AvatarRenderer(Identity.from_seed(identity), clip.scene, clip.spec.size).render_many(clip.states)


@dataclass
class Case:
    """One held-out case: `clip` (driving audio; its render `gt` [F, S, S, 3]) and `reference`
    [F_r, S, S, 3], another clip of the same identity in another scene. What is computed from it
    once (wrong-identity render, the reference's reads, the ground truth's evaluation) is kept."""

    name: str
    clip: Clip
    ref_spec: ClipSpec
    gt: np.ndarray
    reference: np.ndarray
    wrong_identity: int
    wrong_frames: np.ndarray | None = None
    reference_reads: tuple[torch.Tensor, np.ndarray] | None = None
    gt_eval: Evaluation | None = None

    def wrong_identity_frames(self) -> np.ndarray:
        if self.wrong_frames is None:
            self.wrong_frames = render_wrong_identity(self.clip, self.wrong_identity)
        return self.wrong_frames

    def info(self) -> dict[str, Any]:
        s = self.clip.spec
        return {"name": self.name, "identity": s.identity, "voice": s.voice, "scene": s.scene,
                "reference_scene": self.ref_spec.scene, "wrong_identity": self.wrong_identity, "text": self.clip.texts}


def check_bench_args(split: str, seconds: float, clips: int) -> None:
    check_split(split)
    if split == "train":
        raise InputError("benchmark splits are heldout-identity and heldout-voice (train is what the models saw)")
    if clips < 1:
        raise InputError("--clips must be at least 1")
    if not 1.0 <= seconds <= 600:
        raise InputError("--seconds must be between 1 and 600")


def check_run_options(model: str, reference_mode: str = "video", steps: int | None = None) -> None:
    if reference_mode not in REFERENCE_MODES:
        raise InputError(f"--reference-mode must be video or frame, got {reference_mode!r}")
    if steps is not None and not 1 <= steps <= MAX_STEPS:
        raise InputError(f"--steps must be between 1 and {MAX_STEPS}, got {steps}")
    if (model in BASELINES or model.startswith(ROUNDTRIP)) and (reference_mode != "video" or steps is not None):
        raise InputError(f"--reference-mode and --steps apply to registry models; {model} is a baseline")


ROUNDTRIP = "vae-roundtrip:"


def load_subject(model: str, device: str = "cpu") -> Any:
    """The ModelSet of a registry model (or of the model a `vae-roundtrip:NAME` baseline uses) on
    `device`; None for the other baselines; unknown names are a ConfigError."""
    if model in BASELINES:
        return None
    if model.startswith(ROUNDTRIP):
        model = model[len(ROUNDTRIP):]
    from avatarstream.registry import available_models, load_model, model_spec_for

    try:
        model_spec_for(model)  # a registered name or a weights folder
    except ConfigError:
        raise ConfigError(f"unknown model {model!r}; available: {', '.join(BASELINES + tuple(available_models()))}, "
                          "or a weights folder made by `avatarstream train export`") from None
    return load_model(model, device=device)


def make_cases(split: str, *, seconds: float, clips: int, seed: int) -> list[Case]:
    """Render the `clips` cases of `split` (ground truth and reference of each)."""
    specs = clip_specs(DatasetConfig(identities=clips, clips_per_identity=2, seconds=seconds, seed=seed, split=split))
    cases = []
    for i in range(clips):
        target, ref_spec = specs[2 * i], specs[2 * i + 1]
        clip = Clip(target)
        cases.append(Case(f"case{i}", clip, ref_spec, clip.frames(), Clip(ref_spec).frames(),
                          wrong_identity_for(target.identity, seed)))
    return cases


def generate(models: Any, reference: np.ndarray, audio: np.ndarray, frames: int, *,
             steps: int | None = None) -> Generated:
    """Run the model's pipeline: `frames` frames for `audio` [N] from `reference` [F_r, S, S, 3]
    uint8 (the first 1 + 4k frames it can use), with `steps` denoising steps (None: its own)."""
    from avatarstream.engine.pipeline import Pipeline
    from avatarstream.media.reference import square_resize, usable_frame_count

    cfg = models.config if steps is None else dataclasses.replace(models.config, steps=steps)
    k = usable_frame_count(min(len(reference), cfg.ref_pixel_frames))
    ref = torch.stack([square_resize(f, cfg.hr_size) for f in reference[:k]])  # [k, 3, hr, hr]
    step = cfg.sample_rate // 5
    chunks = iter([torch.from_numpy(audio[i:i + step].copy()) for i in range(0, len(audio), step)])
    sink = CollectSink()
    summary = Pipeline(models, cfg).run(ref, chunks, [sink])
    out = np.stack(sink.frames[:frames]) if sink.frames else np.zeros((0, cfg.hr_size, cfg.hr_size, 3), np.uint8)
    if len(out) < frames:  # a model that stops short is scored on a held last frame
        pad = np.repeat(out[-1:] if len(out) else reference[:1, :cfg.hr_size, :cfg.hr_size], frames - len(out), 0)
        out = np.concatenate([out, pad])
    return Generated(out, sink.chunk_starts, fps=summary.fps, ttff_s=summary.ttff_s,
                     extra={"rtf": summary.rtf, "frames_generated": summary.frames, "steps": cfg.steps})


@torch.no_grad()
def vae_roundtrip(models: Any, frames: np.ndarray, latent_noise: float = 0.0, seed: int = 0) -> np.ndarray:
    """frames `[F, S, S, 3]` uint8 -> the same through the model's causal VAE at its output size
    (encoded whole, posterior mean decoded; frames past the last 1 + 4k repeat the last one).
    `latent_noise` A adds A × each channel's std (over the clip) of Gaussian noise (seed `seed`)
    to the mean before decoding."""
    from avatarstream.engine.stages.decode_publish import to_uint8_frames
    from avatarstream.media.reference import square_resize

    vae = models.vae.model
    k = 1 + 4 * ((len(frames) - 1) // 4)
    x = torch.stack([square_resize(f, models.config.hr_size) for f in frames[:k]])  # [k, 3, S, S]
    x = (x.permute(1, 0, 2, 3)[None].float() / 127.5 - 1.0).to(models.vae.device)
    mean, _ = vae.encode(x)
    if latent_noise > 0:
        std = mean.float().std(dim=(0, 2, 3, 4), keepdim=True)  # [1, C, 1, 1, 1]
        noise = torch.randn(mean.shape, generator=torch.Generator().manual_seed(seed)).to(mean.device)
        mean = (mean.float() + latent_noise * std * noise).to(mean.dtype)
    out = to_uint8_frames(vae.decode(mean)[0])
    if len(out) < len(frames):
        out = np.concatenate([out, np.repeat(out[-1:], len(frames) - len(out), 0)])
    return out


def run_model(name: str, models: Any, case: Case, *, reference_mode: str = "video",
              steps: int | None = None, latent_noise: float = 0.0, seed: int = 0) -> Generated:
    """The video `name` makes for `case`: a baseline's frames, or the model's run (`latent_noise`,
    `seed`: of a `vae-roundtrip:` baseline, see `vae_roundtrip`)."""
    n = len(case.gt)
    nominal = list(range(0, n, NOMINAL_CHUNK))
    if name == "ground-truth":
        return Generated(case.gt, nominal)
    if name == "static-frame":
        return Generated(np.repeat(case.reference[:1], n, 0), nominal)
    if name == "wrong-identity":
        return Generated(case.wrong_identity_frames(), nominal)
    if name.startswith(ROUNDTRIP):
        return Generated(vae_roundtrip(models, case.gt, latent_noise, seed), nominal)
    ref = case.reference[:1] if reference_mode == "frame" else case.reference
    return generate(models, ref, case.clip.audio, n, steps=steps)


class Bench:
    """The cases of one held-out split, scored by the bundled (or given) experts. Each case's
    renders, its reference's reads and its ground truth's evaluation are computed once, however
    many models, modes and step counts are run on it."""

    def __init__(self, split: str, *, seconds: float = 10.0, clips: int = 3, seed: int = 0,
                 experts: Experts | None = None) -> None:
        check_bench_args(split, seconds, clips)
        self.split, self.seconds, self.clips, self.seed = split, seconds, clips, seed
        self.ex = experts or load_experts()
        self.cases = make_cases(split, seconds=seconds, clips=clips, seed=seed)

    def score(self, case: Case, gen: Generated) -> Evaluation:
        """Evaluate generated frames against the case's audio, reference video and ground truth."""
        if case.reference_reads is None:
            case.reference_reads = reference_embedding(self.ex, case.reference)
        ev = evaluate(gen.frames, case.clip.audio, case.reference, self.ex, ground_truth=case.gt,
                      chunk_starts=gen.chunk_starts, reference_reads=case.reference_reads)
        truth = np.array([st.open for st in case.clip.states])  # the renderer's exact opening
        ev.metrics["mouth_track_r"] = mouth_track_r(ev.tracks["mouth_open"], truth)
        return ev

    def ground_truth(self, case: Case) -> Evaluation:
        if case.gt_eval is None:
            case.gt_eval = self.score(case, run_model("ground-truth", None, case))
        return case.gt_eval

    def run(self, case: Case, name: str, models: Any, *, reference_mode: str = "video",
            steps: int | None = None, latent_noise: float = 0.0) -> tuple[Generated, dict[str, Any], Evaluation]:
        """(the video, its metrics incl. fps/ttff, the evaluation with tracks) of `name` on `case`."""
        gen = run_model(name, models, case, reference_mode=reference_mode, steps=steps,
                        latent_noise=latent_noise, seed=self.seed)
        ev = self.ground_truth(case) if name == "ground-truth" else self.score(case, gen)
        m = dict(ev.metrics)
        m.update(fps=gen.fps, ttff_s=gen.ttff_s, **gen.extra)
        return gen, m, ev


def _mean(vals: list[Any]) -> float | None:
    v = [float(x) for x in vals if x is not None]
    return float(np.mean(v)) if v else None


def summarize(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over cases of the summary keys (None where no case has a value) and the median offset."""
    out: dict[str, Any] = {k: _mean([m.get(k) for m in metrics]) for k in SUMMARY_KEYS}
    offs = [m["offset_frames"] for m in metrics if m.get("offset_frames") is not None]
    out["offset_frames"] = int(np.median(offs)) if offs else None
    return out


def run_benchmark(model: str, split: str, *, seconds: float = 10.0, clips: int = 3, seed: int = 0,
                  out: Path | None = None, experts: Experts | None = None, plots: bool = True,
                  reference_mode: str = "video", steps: int | None = None,
                  seconds_per_chunk: float | None = None, strategy: str | None = None,
                  latent_noise: float | None = None, device: str = "cpu") -> dict[str, Any]:
    """Score `model` on `clips` cases of `split`; writes OUT/report.{json,md} and PNGs when `out`
    is given; returns the summary (stable keys + per-case metrics). `seconds_per_chunk`: run the
    model with that chunk length instead of its own (the live server's, for instance); `strategy`:
    with that continuity strategy instead of its own (prefix, interp, causal); `latent_noise`: of
    a `vae-roundtrip:` baseline (see `vae_roundtrip`); `device`: where the model runs (cpu, cuda)."""
    from avatarstream.hardware import check_device

    check_device(device)
    check_bench_args(split, seconds, clips)
    check_run_options(model, reference_mode, steps)
    if seconds_per_chunk is not None and (model in BASELINES or model.startswith(ROUNDTRIP)):
        raise InputError(f"--seconds-per-chunk applies to registry models; {model} is a baseline")
    if strategy is not None and (model in BASELINES or model.startswith(ROUNDTRIP)):
        raise InputError(f"--strategy applies to registry models; {model} is a baseline")
    if latent_noise is not None and not model.startswith(ROUNDTRIP):
        raise InputError(f"--latent-noise applies to the vae-roundtrip:NAME baseline, not {model}")
    if latent_noise is not None and not 0.0 <= latent_noise <= 10.0:
        raise InputError(f"--latent-noise must be between 0 and 10, got {latent_noise}")
    if strategy is not None and strategy not in STRATEGIES:
        raise InputError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    models = load_subject(model, device)
    if strategy is not None:
        models.config = dataclasses.replace(models.config, strategy=strategy)
    if seconds_per_chunk is not None:
        models.config = dataclasses.replace(models.config, chunk=models.config.chunk_for_seconds(seconds_per_chunk))
    t0 = time.perf_counter()
    bench = Bench(split, seconds=seconds, clips=clips, seed=seed, experts=experts)
    cases: list[dict[str, Any]] = []
    for case in bench.cases:
        gen, m, ev = bench.run(case, model, models, reference_mode=reference_mode, steps=steps,
                               latent_noise=latent_noise or 0.0)
        row = {**case.info(), "metrics": m, "drift": ev.drift}
        if out is not None and plots:
            out.mkdir(parents=True, exist_ok=True)
            gt_tr = None if model == "ground-truth" else bench.ground_truth(case).tracks
            row["plots"] = plot_case(out, case.name, ev.tracks, gt_tr)
            row["plots"].append(frame_strip(out, case.name, [gen.frames, case.gt, case.reference]))
        cases.append(row)
    summary = summarize([c["metrics"] for c in cases])
    summary.update(model=model, split=split, seed=seed, clips=clips, seconds=seconds,
                   reference_mode=reference_mode if models is not None else None,
                   steps=(models.config.steps if steps is None else steps) if models is not None else None,
                   chunk=models.config.chunk if models is not None else None,
                   strategy=models.config.strategy if models is not None else None,
                   latent_noise=latent_noise,
                   wall_s=round(time.perf_counter() - t0, 2),
                   cases=[{k: v for k, v in c.items() if k != "plots"} for c in cases])
    if out is not None:
        mode = f", {reference_mode} reference, {summary['steps']} steps" if models is not None else ""
        path = write_report(out, summary, cases, f"Benchmark: {model} on {split} (seed {seed}, {clips} × {seconds:g} s{mode})")
        summary["report"] = str(path)
    return summary
