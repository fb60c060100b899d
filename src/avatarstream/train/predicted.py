"""The DiT's own latents for a decoder fine-tune (`avatarstream train predict`).

A VAE decoder is trained on the encoder's latents; at inference it decodes the DiT's few-step
prediction, which lies near those latents but not on them, and the decoder renders what is off
their manifold as artefacts (the bundled model's streaks in open mouths). This module runs a
trained DiT over every clip of a prepared file the way the engine does — the `prefix` strategy's
chunks (`chunk` latent frames, the first `overlap` of them given clean, the first chunk given the
clip's first latent frame as the scene frame), the model's sampler, steps and guidance scales,
its reference length — except that the given frames are the clip's own encoded latents (teacher
forcing), so that every chunk is independent and every prediction stays aligned with the clip's
pixels. `vae.predicted` then trains the decoder to turn these latents into the clip's frames.

Output: a safetensors file `pred [V, N, C, H, W]` float16 (V variants: independent noise draws;
N = the prepared file's latent frames, in its order; frames a chunk was given keep the encoded
latents) with the source prepared file's clip table in its metadata."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from avatarstream.errors import ConfigError, InputError
from avatarstream.models.dit import DiTCondition
from avatarstream.train.data import motion_descriptor
from avatarstream.engine.stages.audio_to_video import pack, unpack
from avatarstream.samplers import flow_sigmas, sample_euler, sample_stochastic_euler

PREDICTED_VERSION = 1


def _chunk_starts(n: int, chunk: int, overlap: int) -> list[int]:
    """Starts of the chunks covering latent frames 0..n−1 with `overlap` given frames each (the
    last chunk moved back to end at n)."""
    if n <= chunk:
        return [0]
    starts = list(range(0, n - chunk + 1, chunk - overlap))
    if starts[-1] + chunk < n:
        starts.append(n - chunk)
    return starts


@torch.no_grad()
def predict_latents(prepared: str | Path, weights: str | Path, out: str | Path, *, variants: int = 2,
                    sigma_start: float = 1.0, seed: int = 0, max_clips: int | None = None,
                    progress: bool = False) -> dict[str, Any]:
    """Write the DiT of the weights folder `weights` 's predicted latents of every clip of
    `prepared` to `out` (see the module docstring). `sigma_start` < 1 starts the sampler from the
    clip's latents noised to that σ instead of pure noise (its schedule's remaining steps)."""
    from safetensors.torch import save_file

    from avatarstream.train.recipe import resolve
    from avatarstream.train.tasks import CFGDistillTask
    from avatarstream.train.trainer import net_weights

    wdir = Path(weights)
    if not (wdir / "config.json").is_file():
        raise InputError(f"{wdir}: not a weights folder (no config.json; make one with `train export`)")
    if not 0.0 < sigma_start <= 1.0:
        raise ConfigError(f"--sigma-start must lie in (0, 1], got {sigma_start}")
    if variants < 1:
        raise ConfigError("--variants must be at least 1")
    conf = json.loads((wdir / "config.json").read_text())
    p = conf["pipeline"]
    direct = p["lr_size"] == p["hr_size"]
    chunk, overlap = int(p["chunk"]), int(p["overlap"])
    raw = {"stage": "cfg-distill", "model": conf["model"], "data": {"prepared": str(prepared)},
           "init": {"dit": str(wdir)},
           "cfg-distill": {"direct": direct, "chunk": chunk, "ref_frames": int(p["ref_frames"]),
                           "ref_t_position": float(p["ref_t_position"]),
                           "audio_window": int(p["audio_window"])}}
    task = CFGDistillTask(resolve(raw, name="predict"), torch.device("cpu"))
    nets = task.nets
    for k in ("dit", "audio", "text"):
        nets[k].load_state_dict(net_weights(wdir, k))
        nets[k].eval()
    data = task.data
    guidance = None
    if p.get("guidance_input"):
        guidance = torch.tensor([[float(p["audio_scale"]), float(p["ref_scale"])]])
    elif p.get("audio_scale") is not None:
        raise ConfigError(f"{wdir}: predict runs CFG-distilled models only (pipeline.guidance_input)")
    sig_all = flow_sigmas(int(p["steps"]), float(p["shift"]))
    sigmas = torch.cat([torch.tensor([sigma_start]), sig_all[sig_all < sigma_start]])
    text, text_mask = nets["text"].encode([""])
    src = data.lr  # the DiT's latents (the HR ones for a direct DiT)
    pred = src[None].repeat(variants, 1, 1, 1, 1).half()
    clips = list(range(len(data.clips)))[: max_clips or None]
    it = clips
    if progress:
        from tqdm import tqdm
        it = tqdm(clips, desc="predicting clips", unit="clip")
    g = torch.Generator().manual_seed(seed)
    T = chunk
    for i in it:
        c = data.clips[i]
        n = c["latents"]
        if n < T:
            continue
        starts = _chunk_starts(n, T, overlap)
        B = len(starts)
        lat, valid, mot, _ = task.reference(g, i, hr=False, p_cross=1.0)
        valid[:] = False
        valid[: min(lat.shape[1], n)] = True
        cache = nets["dit"].encode_reference(lat[None].expand(B, *lat.shape), valid[None].expand(B, -1),
                                             torch.full((lat.shape[1],), float(p["ref_t_position"])))
        x0 = torch.stack([data.latents(i, s, T) for s in starts])  # [B, C, T, h, w]
        m0 = torch.stack([motion_descriptor(data.table(i), torch.arange(s, s + T), task.motion_dim)
                          for s in starts])
        given = torch.zeros(B, T, dtype=torch.bool)
        given[0, 0] = True  # the first chunk: the scene frame
        given[1:, :overlap] = True
        audio = task.audio_tokens(nets["audio"], [i] * B, starts, torch.zeros(B, dtype=torch.bool))
        anchor = task.scene_anchor([i] * B)
        cond_text = text.expand(B, *text.shape[1:])
        cond_mask = None if text_mask is None else text_mask.expand(B, -1)
        gd = None if guidance is None else guidance.expand(B, 2)
        for v in range(variants):
            eps = torch.randn(x0.shape, generator=g)
            eps_m = torch.randn(m0.shape, generator=g)
            s0 = sigmas[0]
            g5 = given[:, None, :, None, None]
            gm = given[..., None]

            def denoise(flat: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
                # as AudioToVideoStage: given frames held clean at σ = 0, their velocity zero
                xs, ms = unpack(flat, x0.shape, m0.shape)
                xs, ms = torch.where(g5, x0, xs), torch.where(gm, m0, ms)
                sig = torch.full((B, T), float(sigma)).masked_fill(given, 0.0)
                cond = DiTCondition(motion=ms, audio=audio, text=cond_text, text_mask=cond_mask,
                                    t_pos=torch.arange(T, dtype=torch.float32), guidance=gd, anchor=anchor)
                o = nets["dit"](xs, sig, cond, cache)
                return pack(o.velocity.float().masked_fill(g5, 0.0), o.motion_velocity.float().masked_fill(gm, 0.0))

            state0 = pack((1 - s0) * x0 + s0 * eps, (1 - s0) * m0 + s0 * eps_m)
            if p["sampler"] == "euler":
                flat = sample_euler(denoise, state0, sigmas)
            else:
                flat = sample_stochastic_euler(denoise, state0, sigmas, overshoot=float(p["overshoot"]), generator=g)
            x = torch.where(g5, x0, unpack(flat, x0.shape, m0.shape)[0])
            for b, s in enumerate(starts):
                # a chunk writes the frames it generated; a later chunk's given frames are earlier
                # chunks' generated ones, so nothing is overwritten with a given frame
                keep = ~given[b]
                idx = torch.arange(s, s + T)[keep] + c["lat_offset"]
                pred[v, idx] = x[b][:, keep].permute(1, 0, 2, 3).half()
    meta = {"version": PREDICTED_VERSION, "prepared": str(prepared), "weights": str(wdir),
            "sigma_start": sigma_start, "sigmas": [round(float(s), 4) for s in sigmas],
            "guidance": None if guidance is None else guidance[0].tolist(), "chunk": T, "overlap": overlap,
            "direct": direct, "variants": variants, "seed": seed,
            "clips": [{"key": c["key"], "lat_offset": c["lat_offset"], "latents": c["latents"]}
                      for c in data.clips]}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file({"pred": pred.contiguous()}, str(tmp), metadata={"avatarstream": json.dumps(meta)})
    tmp.replace(out)
    err = (pred.float() - src[None]).square().mean().sqrt()
    return {"out": str(out), "clips": len(clips), "variants": variants, "latent_frames": int(src.shape[0]),
            "sigmas": meta["sigmas"], "guidance": meta["guidance"], "rms_to_encoded": round(float(err), 4),
            "bytes": out.stat().st_size}


class PredictedLatents:
    """A file made by `predict_latents` in memory: `latents(key, v, start, length)` →
    `[C, length, H, W]` float32 of variant v of the clip with that key."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise InputError(f"no predicted-latents file at {path} (make it with `avatarstream train predict`)")
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("avatarstream", "{}"))
            if meta.get("version") != PREDICTED_VERSION:
                raise InputError(f"{path} is not a predicted-latents file of version {PREDICTED_VERSION}")
            self.pred = f.get_tensor("pred")
        self.meta = meta
        self.by_key = {c["key"]: c for c in meta["clips"]}

    @property
    def variants(self) -> int:
        return int(self.pred.shape[0])

    def latents(self, key: str, v: int, start: int, length: int) -> torch.Tensor:
        a = self.by_key[key]["lat_offset"] + start
        return self.pred[v, a:a + length].float().permute(1, 0, 2, 3)
