"""Recipes: TOML files (read with tomllib) that say what a training run does.

A recipe names a `stage` (`vae`, `a2v`, `sr`), a `model` size preset (`tiny`, `small`: the
registry's network sizes and geometry) and sections whose every key has a default here
(`DEFAULTS`); unknown sections or keys are errors (typos never pass silently). `RECIPE` may be a
path or a name looked up in the `recipes/` folder (of the current directory, then of the source
checkout). `--set section.key=value` overrides (value parsed as TOML, else a string).

Stages: `vae`, `a2v` (pre-training and personality SFT), `sr`, `cfg-distill`, the causal
student's `df` (diffusion forcing) and `dmd` (Self-Forcing DMD), and feedback alignment of a
registry model's DiT: `grpo` (rewards on its own rollouts) and `dpo` (preference pairs).
Sections: `[train]` (steps, batch, seed, optimiser, EMA, precision, checkpoints), `[data]`
(`shards` for vae, `prepared` for a2v/sr; relative paths are relative to the working
directory, so run from the repository root),
`[init]` (net name -> run folder or .safetensors to start that net from; e.g. `sr` takes the
audio/text encoders of an `a2v` run), and one section named after the stage (its losses and
sampling).
"""

from __future__ import annotations

import copy
import hashlib
import json
import tomllib
from pathlib import Path
from typing import Any

from avatarstream.errors import ConfigError

STAGES = ("vae", "a2v", "sr", "cfg-distill", "df", "dmd", "grpo", "dpo")
MODELS = ("tiny", "small")

DEFAULTS: dict[str, dict[str, Any]] = {
    "train": {"steps": 1000, "batch": 4, "seed": 0, "lr": 1e-3, "warmup": 50, "min_lr_ratio": 0.1,
              "weight_decay": 0.01, "betas": [0.9, 0.95], "muon_momentum": 0.95, "grad_clip": 1.0,
              "ema": 0.999, "bf16": "auto", "checkpoint_every": 500, "checkpoint_minutes": 20.0,
              "keep": 2, "plot_every": 100, "threads": 0},
    "data": {"shards": "", "prepared": "", "max_clips": 0},
    "init": {"dit": "", "refiner": "", "vae": "", "audio": "", "text": ""},
    "vae": {"latent_frames": 3, "warm_latents": 0, "p_stream_start": 0.25, "crop": 128, "p_lr": 0.5, "kl": 1e-4, "grad": 0.5, "multiscale": 0.5,
            "temporal": 0.25, "mouth": 4.0, "eyes": 2.0, "radius": 0.06, "train_encoder": True,
            "p_mouth_crop": 0.0, "mouth_temporal": 0.0, "latent_noise": 0.0},
    "a2v": {"chunk": 8, "ref_frames": 8, "p_ref2v": 0.4, "p_prefix": 0.4, "p_interp": 0.2, "overlap": 2,
            "first_frame": True, "p_clip_start": 0.5,
            "logit_mean": 0.0, "logit_std": 1.0, "motion": 0.5, "ref_motion": 0.1, "mouth": 2.0,
            "eyes": 1.0, "radius": 0.06, "p_drop_audio": 0.1, "p_drop_ref": 0.05, "p_empty_text": 0.5,
            "p_cross_scene": 1.0, "audio_window": 1, "ref_t_position": -8.0, "train_audio": True,
            "train_text": True, "human_sync": 0.0, "human_identity": 0.0, "p_human": 1.0,
            "human_context": 4, "direct": False},
    "cfg-distill": {},
    "sr": {"chunk": 4, "ref_frames": 8, "sigma": 0.6, "p_sigma_jitter": 0.25, "sigma_jitter": 0.2,
           "lr_noise": 0.05, "mouth": 2.0, "eyes": 1.0, "radius": 0.06, "p_empty_text": 0.5,
           "audio_window": 1, "ref_t_position": -8.0},
}


DEFAULTS["cfg-distill"] = {**DEFAULTS["a2v"], "human_sync": 0.0, "human_identity": 0.0, "p_drop_audio": 0.0, "p_drop_ref": 0.0, "audio_scale": 3.0,
                           "ref_scale": 1.5, "train_audio": False, "train_text": False,
                           # scales as inputs: drawn per sample from these ranges; audio_scale /
                           # ref_scale above become the exported model's default scales
                           "guidance_input": True, "audio_scale_min": 1.0, "audio_scale_max": 5.0,
                           "ref_scale_min": 1.0, "ref_scale_max": 3.0}

# The causal student (train/objectives/): diffusion forcing, then Self-Forcing DMD.
_CAUSAL = {"chunk": 12, "block": 3, "history": 4, "ref_frames": 8, "p_cross_scene": 1.0, "audio_window": 1,
           "p_empty_text": 0.5, "ref_t_position": -8.0, "rolling_rope": True, "logit_mean": 0.0,
           "logit_std": 1.0, "motion": 0.5,
           # a DiT generating at the output resolution (a2v `direct`); the student's (audio,
           # reference) guidance scales, inputs of a CFG-distilled DiT ([] = none: its plain
           # conditional prediction)
           "direct": False, "guidance": []}
DEFAULTS["df"] = {**_CAUSAL, "p_shared_sigma": 0.25, "mouth": 2.0, "eyes": 1.0, "radius": 0.06}
DEFAULTS["dmd"] = {**_CAUSAL, "steps": 4, "shift": 1.0, "sigma_min": 0.02, "sigma_max": 0.98,
                   "history_corrupt": 0.05, "adaptive_sink": True, "blockwise_grad": True, "teacher": "",
                   # what a block leaves in step j's cache: its K/V at step j's input ("same":
                   # timestep forcing) or at its output ("next": one more forward a step), as the
                   # engine's CausalSettings.history_level; export carries it into the model
                   "history_level": "same",
                   # mouth/eye emphasis of the DMD gradient (0, 0: uniform)
                   "mouth": 0.0, "eyes": 0.0, "radius": 0.06,
                   # scales the real and fake scores get (a CFG-distilled teacher: the guided
                   # distribution the student is distilled to)
                   "teacher_guidance": [],
                   # the generator updates on 1 in fake_updates iterations, the fake score on all
                   "fake_updates": 1,
                   # the real and fake scores see the window in pieces of this many latent frames
                   # (0: whole); a bidirectional model trained on chunks of 8 scores 7 well, 21 not
                   "score_window": 0,
                   # each scored piece led by the sample's clean frame before it (see
                   # SelfForcingDMDTask._score_velocity)
                   "score_given": False,
                   # the DMD gradient at the first latent frame of every block after the first
                   # weighted 1 + block_start (0: uniform): emphasis on the block seams
                   "block_start": 0.0,
                   # the fake score's starting weights (a dmd run or weights folder: continue a
                   # distillation with its fake score; "": the teacher's)
                   "fake_init": ""}

# Feedback alignment (train/objectives/grpo.py, dpo.py) of a registry model's DiT (`model`: a
# name or weights folder); the KL anchor is that DiT, frozen.
_ALIGN = {"model": "avatarstream-small", "kl": 0.05, "bf16_rollouts": "auto"}
DEFAULTS["grpo"] = {**_ALIGN,
                    # "flow-grpo": per-step Gaussian log-probabilities of the stochastic sampler,
                    # clipped ratio; "nft": DiffusionNFT, reward-weighted flow matching on the
                    # rollouts' clean samples (likelihood-free; rollouts with the model's sampler)
                    "method": "flow-grpo", "group": 4, "overshoot": 0.5, "clip": 0.2,
                    "adv_clip": 3.0, "nft_beta": 1.0, "logit_mean": 0.0, "logit_std": 1.0,
                    # the conditions: synthetic train-split clips (identity, reference clip in
                    # another scene, speech, the renderer's mouth track), drawn by `condition_seed`
                    "conditions": 16, "seconds": 2.0, "condition_seed": 7,
                    # reward weights (train/rewards.py TERMS); -1: the module's default
                    "w_sync": -1.0, "w_mouth_track": -1.0, "w_identity": -1.0, "w_cadence": -1.0,
                    "w_head_motion": -1.0, "w_mouth_hf": -1.0, "w_silence": -1.0}
DEFAULTS["dpo"] = {**_ALIGN, "prefs": "", "beta": 200.0, "logit_mean": 0.0, "logit_std": 1.0}

# Keys that recipes had and no longer have, with the value every run that resumes had (their
# defaults): the fingerprint of a checkpoint made before they went includes them, so `fingerprint`
# adds them back and such a run still resumes. (Gone with the experiments of issue 27: the decoder
# fine-tune on a DiT's latents, the prefix DMD student, and our own Muon's float32 Newton–Schulz.)
RETIRED: dict[str, dict[str, Any]] = {
    "train": {"muon_bf16": "auto"},
    "vae": {"predicted": "", "p_predicted": 0.75},
    "dmd": {"strategy": "causal", "prefix_chunk": 8, "overlap": 2},
}


def recipe_dirs() -> list[Path]:
    here = Path(__file__).resolve()
    return [Path.cwd() / "recipes", here.parents[3] / "recipes"]


def find_recipe(name: str) -> Path:
    p = Path(name)
    if p.suffix == ".toml" and p.is_file():
        return p
    for d in recipe_dirs():
        q = d / (name if name.endswith(".toml") else f"{name}.toml")
        if q.is_file():
            return q
    known = sorted({q.stem for d in recipe_dirs() if d.is_dir() for q in d.glob("*.toml")})
    raise ConfigError(f"no recipe {name!r} (a .toml path or one of: {', '.join(known) or 'none found'})")


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_recipe(name_or_path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Recipe dict with every default filled in, `_path` and `name` set, overrides applied."""
    path = find_recipe(str(name_or_path))
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from e
    for item in overrides or []:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"--set wants section.key=value, got {item!r}")
        key, val = item.split("=", 1)
        sec, k = key.strip().split(".", 1)
        raw.setdefault(sec, {})[k] = _parse_value(val.strip())
    return resolve(raw, base=path.parent, name=path.stem)


def resolve(raw: dict[str, Any], *, base: Path | None = None, name: str = "recipe") -> dict[str, Any]:
    """Validate a raw recipe dict and fill defaults."""
    raw = copy.deepcopy(raw)
    stage = raw.pop("stage", None)
    if stage not in STAGES:
        raise ConfigError(f"recipe {name}: stage must be one of {', '.join(STAGES)}, got {stage!r}")
    model = raw.pop("model", "tiny")
    if model not in MODELS:
        raise ConfigError(f"recipe {name}: model must be one of {', '.join(MODELS)}, got {model!r}")
    rname = raw.pop("name", name)
    out: dict[str, Any] = {"stage": stage, "model": model, "name": rname}
    for sec, vals in raw.items():
        if sec not in DEFAULTS or (sec in STAGES and sec != stage):
            raise ConfigError(f"recipe {rname}: unknown section [{sec}]")
        if not isinstance(vals, dict):
            raise ConfigError(f"recipe {rname}: [{sec}] must be a table")
        bad = set(vals) - set(DEFAULTS[sec])
        if bad:
            raise ConfigError(f"recipe {rname}: unknown key(s) in [{sec}]: {', '.join(sorted(bad))}")
    for sec in ("train", "data", "init", stage):
        merged = dict(DEFAULTS[sec])
        merged.update(raw.get(sec, {}))
        for k, v in merged.items():
            d = DEFAULTS[sec][k]
            if isinstance(d, bool) and not isinstance(v, bool):
                raise ConfigError(f"recipe {rname}: {sec}.{k} must be true or false")
            if isinstance(d, (int, float)) and not isinstance(d, bool):
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ConfigError(f"recipe {rname}: {sec}.{k} must be a number, got {v!r}")
                if isinstance(d, int) and not isinstance(d, bool) and isinstance(v, float) and not v.is_integer():
                    raise ConfigError(f"recipe {rname}: {sec}.{k} must be an integer")
                merged[k] = type(d)(v) if not (isinstance(d, int) and isinstance(v, float)) else int(v)
        out[sec] = merged
    if out["train"]["bf16"] not in (True, False, "auto"):  # "auto": only where it is fast (hardware.py)
        raise ConfigError(f"recipe {rname}: train.bf16 must be true, false or \"auto\"")
    for k in ("shards", "prepared"):
        if out["data"][k]:
            out["data"][k] = str(Path(out["data"][k]).expanduser())
    t = out["train"]
    if t["steps"] < 1 or t["batch"] < 1:
        raise ConfigError(f"recipe {rname}: train.steps and train.batch must be at least 1")
    if not 0 <= t["ema"] < 1:
        raise ConfigError(f"recipe {rname}: train.ema must be in [0, 1)")
    if t["checkpoint_every"] < 1 or t["keep"] < 1:
        raise ConfigError(f"recipe {rname}: train.checkpoint_every and train.keep must be at least 1")
    return out


def fingerprint(recipe: dict[str, Any]) -> str:
    """Hash of what determines the trajectory: everything but checkpoint/plot cadence, threads,
    and where the data and `[init]` weights live (a run may resume on another machine, e.g. a
    GPU box with the prepared file elsewhere; `[init]` is only read when a run starts). Retired
    keys count at the value they had (`RETIRED`), so older runs keep their fingerprint."""
    r = copy.deepcopy(recipe)
    for sec, keys in RETIRED.items():
        if sec in r:
            r[sec] = {**r[sec], **keys}
    for k in ("checkpoint_every", "checkpoint_minutes", "keep", "plot_every", "threads"):
        r["train"].pop(k, None)
    r.pop("init", None)
    r["data"] = {k: v for k, v in r["data"].items() if k not in ("shards", "prepared")}
    return hashlib.sha256(json.dumps(r, sort_keys=True).encode()).hexdigest()[:16]
