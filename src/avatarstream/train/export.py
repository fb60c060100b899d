"""`avatarstream train export RUN_DIR [RUN_DIR ...] --out weights/NAME/`: one weights folder the
registry can load.

For each of the five networks the weights come from the first run (in the order given) that
*trained* it (its EMA weights; the VAE from the prepared file the latent runs trained on, with
its decoder from a decoder fine-tuning run if one is given); a network no run trained is taken from a run that held it frozen
(e.g. the audio encoder copied into an `sr` run), else it keeps its deterministic initial weights
and is listed under `untrained` in config.json. All runs must share one model size preset.
A DiT trained `direct` (a2v `direct = true`: at the output resolution) makes a model without a
refiner: no `refiner.safetensors`, `pipeline.lr_size` = `hr_size`. A causal student (a `df` or
`dmd` run) makes a model whose default strategy is `causal`, with the block, window and guidance
scales it was trained with (a `dmd` student: its step count too).

Folder: `{dit,refiner,vae,audio,text}.safetensors` + `config.json` = {"model": preset, network
configs, "pipeline": the preset's PipelineConfig fields, "trained": net -> run, "untrained"}.
This module is the write side only; the folder is read by `avatarstream.weights` (its
`model_spec(folder)` is the registry's `ModelSpec`, weights=folder), which the trainer never is.

`--share-with FOLDER`: a network whose file comes out byte-identical to FOLDER's is not stored
twice; config.json's `"shared"` maps it to {"file": the path relative to this folder, "sha256"}
(a causal student keeps its teacher's VAE, audio and text encoders); readers check the hash
(`weights.weights_file`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from avatarstream.errors import InputError
from avatarstream.train.checkpoints import load_checkpoint
from avatarstream.train.nets import NETS, build_nets, init_net, vae_for
from avatarstream.weights.folder import file_sha256, weights_file
from avatarstream.weights.spec import pipeline_preset


def _prepared_vae(runs: list[tuple[Path, dict, dict]], prepared: str | Path | None) -> tuple[dict | None, str | None]:
    """The VAE state (latent statistics folded in) of the prepared file the latent-space runs
    trained on: `prepared` if given, else the `data.prepared` of the runs' recipes. (None, None)
    when no run trained on a prepared file (e.g. a VAE-only export)."""
    from safetensors.torch import load_file

    if prepared is None:
        paths = set()
        for rd, _, _ in runs:
            rec = rd / "recipe.json"
            if rec.is_file():
                p = json.loads(rec.read_text()).get("data", {}).get("prepared", "")
                if p:
                    paths.add(p)
        if not paths:
            return None, None
        if len(paths) > 1:
            raise InputError(f"the runs trained on different prepared files {sorted(paths)}; "
                             "pass --prepared FILE (the one whose VAE to bundle)")
        prepared = paths.pop()
    prepared = Path(prepared)
    if not prepared.is_file():
        raise InputError(f"{prepared}: the prepared file the runs trained on is missing; its VAE (with "
                         "the latent statistics folded in) is the one to bundle: pass --prepared FILE")
    t = load_file(str(prepared))
    vae = {k[4:]: v for k, v in t.items() if k.startswith("vae.")}
    if not vae:
        raise InputError(f"{prepared}: no VAE inside (an old prepared file?); re-run `train prepare`")
    return vae, str(prepared)


def export(run_dirs: list[str | Path], out: str | Path, *, seed: int = 0, prepared: str | Path | None = None,
           dtype: str = "bf16", steps: int | None = None, share_with: str | Path | None = None) -> dict[str, Any]:
    """dtype: storage of floating-point tensors ("bf16" halves the bundle; loading casts back to
    the model's dtype) or "fp32"; steps: the model's default denoising steps (None: the
    preset's); share_with: a weights folder whose byte-identical files this one refers to instead
    of copying."""
    from safetensors.torch import save_file

    if dtype not in ("bf16", "fp32"):
        raise InputError(f"--dtype must be bf16 or fp32, got {dtype!r}")

    stages = {json.loads((Path(rd) / "recipe.json").read_text()).get("stage")
              for rd in run_dirs if (Path(rd) / "recipe.json").is_file()}
    if stages & {"grpo", "dpo"}:  # an aligned model: the base with the run's DiT (align_export.py)
        if len(run_dirs) != 1:
            raise InputError("export a grpo/dpo run on its own: its model is the base it aligned")
        from avatarstream.train.align_export import export_aligned

        return export_aligned(run_dirs[0], out, dtype=None if dtype == "bf16" else dtype)
    runs = []
    for rd in run_dirs:
        rd = Path(rd)
        ck = load_checkpoint(rd)
        if ck is None:
            raise InputError(f"{rd}: no checkpoint (is it a training run folder?)")
        runs.append((rd, *ck))
    models = {side["model"] for _, side, _ in runs}
    if len(models) != 1:
        raise InputError(f"runs mix model sizes {sorted(models)}; export runs of one size")
    model = models.pop()
    dit_run = next((side for _, side, _ in runs if "dit" in side["trainable"]), None)
    distill = _run_recipe(runs, dit_run)
    direct = bool(distill.get(distill.get("stage", ""), {}).get("direct", False))
    if direct and any("refiner" in side["trainable"] for _, side, _ in runs):
        raise InputError("the DiT run is direct (it generates at the output resolution): a model "
                         "with it has no SR refiner, leave the sr run out")
    nets = build_nets(model, direct)
    if direct:
        del nets["refiner"]
    trained: dict[str, str] = {}
    frozen: dict[str, str] = {}
    untrained: list[str] = []
    vae_state, vae_src = _prepared_vae(runs, prepared)
    vae_state, vae_src = _finetuned_decoder(runs, vae_state, vae_src)
    for i, name in enumerate(sorted(nets)):
        net = nets[name]
        if name == "vae" and vae_state is not None:
            nets[name] = vae_for(model, vae_state)  # its variant is what config.json records
            trained[name] = vae_src
            continue
        src = next(((rd, t) for rd, side, t in runs if name in side["trainable"]), None)
        prefix = f"ema.{name}."
        if src is None:
            src = next(((rd, t) for rd, side, t in runs if any(k.startswith(f"model.{name}.") for k in t)), None)
            prefix = f"model.{name}."
        if src is None:
            init_net(name, net, seed * 101 + i)
            untrained.append(name)
            continue
        rd, t = src
        sd = net.state_dict()
        for k in sd:  # EMA holds parameters; buffers come from the model copy
            key = prefix + k if prefix + k in t else f"model.{name}.{k}"
            sd[k] = t[key].to(sd[k].dtype)
        net.load_state_dict(sd)
        (trained if prefix.startswith("ema") else frozen)[name] = str(rd)
    out = Path(out)
    if share_with is not None and not (Path(share_with) / "config.json").is_file():
        raise InputError(f"--share-with {share_with}: not a weights folder (no config.json)")
    if share_with is not None and Path(share_with).resolve() == out.resolve():
        raise InputError(f"--share-with {share_with} is the --out folder: name the folder to refer to")
    out.mkdir(parents=True, exist_ok=True)
    total = 0
    shared: dict[str, dict[str, str]] = {}
    stale = out / "refiner.safetensors"
    if direct and stale.exists():  # a folder re-exported as a direct model
        stale.unlink()
    for name in (n for n in NETS if n in nets):
        p = out / f"{name}.safetensors"
        store = torch.bfloat16 if dtype == "bf16" else torch.float32
        save_file({k: (v.to(store) if v.is_floating_point() else v).detach().contiguous()
                   for k, v in nets[name].state_dict().items()}, str(p))
        other = None if share_with is None else weights_file(share_with, name)
        if other is not None and file_sha256(other) == file_sha256(p):
            shared[name] = {"file": os.path.relpath(other.resolve(), out.resolve()), "sha256": file_sha256(p)}
            p.unlink()
            continue
        total += p.stat().st_size
    pipe = pipeline_preset(model)()
    if direct:
        pipe = dataclasses.replace(pipe, lr_size=pipe.hr_size)
    if steps is not None:
        if not 1 <= steps <= 64:
            raise InputError(f"--steps must be between 1 and 64, got {steps}")
        pipe = dataclasses.replace(pipe, steps=steps)
    if distill.get("stage") == "cfg-distill" and distill.get("cfg-distill", {}).get("guidance_input"):
        # the DiT takes the CFG scales as inputs: its run's scales are the model's defaults
        pipe = dataclasses.replace(pipe, audio_scale=distill["cfg-distill"]["audio_scale"],
                                   ref_scale=distill["cfg-distill"]["ref_scale"], guidance_input=True)
    stage = distill.get("stage")
    # a bidirectional DiT was trained with the reference as its only sink: run causally, it keeps
    # it (measured with the weights of docs/strategies.md: Sync-C 0.19-0.21 without AAS, 0.16
    # with, over 100 s); a causal student keeps the sink rule it was trained with
    pipe = dataclasses.replace(pipe, adaptive_sink=False)
    if stage in ("df", "dmd"):
        # a causal student: it streams with the causal strategy, in the block and window it was
        # trained with, at the guidance scales it was trained with (a DMD student: its steps)
        c = distill[stage]
        pipe = dataclasses.replace(pipe, strategy="causal", block=c["block"], kv_blocks=c["history"],
                                   adaptive_sink=bool(c.get("adaptive_sink", False)),
                                   history_level=c.get("history_level", "same"))
        if c.get("guidance"):
            pipe = dataclasses.replace(pipe, audio_scale=float(c["guidance"][0]),
                                       ref_scale=float(c["guidance"][1]), guidance_input=True)
        if stage == "dmd" and steps is None:
            pipe = dataclasses.replace(pipe, steps=c["steps"])
    cfg = {"model": model,
           "configs": {n: dataclasses.asdict(nets[n].cfg if n == "vae" else nets[n].config) for n in NETS if n in nets},
           "pipeline": dataclasses.asdict(pipe), "trained": trained, "dtype": dtype, "frozen_copies": frozen,
           "untrained": untrained}
    if shared:
        cfg["shared"] = shared
    (out / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True))
    return {"out": str(out), "model": model, "bytes": total, "trained": trained,
            "frozen_copies": frozen, "untrained": untrained, "shared": sorted(shared)}


def _finetuned_decoder(runs: list[tuple[Path, dict, dict]], vae_state: dict | None,
                       vae_src: str | None) -> tuple[dict | None, str | None]:
    """A `vae` run with `train_encoder = false` (decoder fine-tuning) among the runs: its EMA VAE
    replaces the prepared file's, after checking its frozen encoder is that VAE's encoder (to
    bf16 storage rounding, 1e-2): otherwise its latent space is not the one the DiT learned."""
    for rd, side, t in runs:
        rec = json.loads((rd / "recipe.json").read_text()) if (rd / "recipe.json").is_file() else {}
        if rec.get("stage") != "vae" or rec.get("vae", {}).get("train_encoder", True):
            continue
        sd = {k[len("ema.vae."):]: v for k, v in t.items() if k.startswith("ema.vae.")}
        if vae_state is not None:
            for k, v in vae_state.items():
                if k.startswith(("encoder.", "quant_conv.")) and not torch.allclose(
                        sd[k].float(), v.float(), rtol=1e-2, atol=1e-2):
                    raise InputError(f"{rd}: its frozen encoder is not the VAE of {vae_src} ({k} "
                                     "differs); fine-tune the decoder from that VAE (init.vae)")
        for k, v in t.items():  # buffers come from the model copy
            if k.startswith("model.vae.") and k[len("model.vae."):] not in sd:
                sd[k[len("model.vae."):]] = v
        return sd, f"{vae_src} (encoder) + {rd} (decoder)" if vae_src else str(rd)
    return vae_state, vae_src


def _run_recipe(runs: list[tuple[Path, dict, dict]], side: dict | None) -> dict[str, Any]:
    """The resolved recipe (recipe.json) of the run whose checkpoint side-car is `side`."""
    for rd, sd, _ in runs:
        if sd is side and (rd / "recipe.json").is_file():
            return json.loads((rd / "recipe.json").read_text())
    return {}
