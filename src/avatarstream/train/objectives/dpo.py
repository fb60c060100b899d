"""Preference alignment by Diffusion-DPO (`stage = "dpo"`, Avatar V §3.5 and §5.3), in the
flow-matching form.

Data: `dpo.prefs`, a JSON-lines file of preference pairs (`avatarstream annotate export` from
people's choices, or `annotate auto` ranked by the reward terms): each line names the `chosen`
and `rejected` rollout records (train/rollout.py `save_rollout`; paths relative to the pairs
folder, which `pairs` gives relative to the file's folder), two renders of one condition. Per step, `train.batch` pairs; per pair and chunk, one σ
(logit-normal) and one noise ε shared by the two renders (as Diffusion-DPO draws them), and the
velocity errors e = |v(x_σ) − (ε − x0)|² of the policy and of the frozen anchor (the reference
model). With Δ = (e_θ(w) − e_ref(w)) − (e_θ(l) − e_ref(l)) summed over the chunks:

    loss = −log σ(−β·Δ)

so the policy lowers its error on the chosen render relative to the anchor more than on the
rejected one; the anchor is the KL term (DPO's implicit one); `kl` adds the explicit
|v_θ − v_ref|² on both renders (0: none).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from avatarstream.errors import ConfigError, InputError
from avatarstream.train.objectives.align import AlignTask, flow_sigma, noisy_state, velocity_error
from avatarstream.train.objectives.base import pick
from avatarstream.train.rollout import ChunkSteps, denoiser_for, load_rollout


def read_prefs(path: str | Path) -> list[dict[str, Any]]:
    """The decisive pairs of a preference file: [{"chosen": Path, "rejected": Path, ...}]."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"dpo.prefs: no preference file at {p} (make one with `avatarstream annotate export` "
                         "or `avatarstream annotate auto`)")
    out = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            base = p.parent / row.get("pairs", ".")  # the pairs folder, relative to this file
            chosen, rejected = base / row["chosen"], base / row["rejected"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise InputError(f"{p}:{n}: not a preference line ({type(e).__name__}: {e})") from None
        for q in (chosen, rejected):
            if not q.is_file():
                raise InputError(f"{p}:{n}: the record {q} is missing")
        out.append({**row, "chosen": chosen, "rejected": rejected})
    if not out:
        raise InputError(f"{p}: no preference pairs in it")
    return out


class DPOTask(AlignTask):
    stage = "dpo"
    progress_keys = ("margin", "accuracy")

    def __init__(self, recipe: dict[str, Any], device: torch.device) -> None:
        super().__init__(recipe, device)
        if not self.cfg["prefs"]:
            raise ConfigError("dpo.prefs: the preference file to train on (--set 'dpo.prefs=\"PAIRS/prefs.jsonl\"')")
        if self.cfg["beta"] <= 0:
            raise ConfigError("dpo.beta must be > 0")
        self.pairs = read_prefs(self.cfg["prefs"])
        self._records: dict[Path, list[ChunkSteps]] = {}

    def record(self, path: Path) -> list[ChunkSteps]:
        if path not in self._records:
            self._records[path] = [self._to_device(ch) for ch in load_rollout(path)[0]]
        return self._records[path]

    def _to_device(self, ch: ChunkSteps) -> ChunkSteps:
        if self.device.type == "cpu":
            return ch
        mv = lambda t: None if t is None else t.to(self.device)  # noqa: E731
        for name in ("x_clean", "m_clean", "given", "audio", "text", "text_mask", "anchor"):
            setattr(ch, name, mv(getattr(ch, name)))
        ch.states = [mv(s) for s in ch.states]
        r = ch.reference
        r.k, r.v, r.motion = [mv(k) for k in r.k], [mv(v) for v in r.v], mv(r.motion)
        r.key_valid = mv(r.key_valid)
        return ch

    def errors(self, chunks: list[ChunkSteps], draws: list[tuple[float, torch.Tensor]]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(policy error, anchor error, explicit KL) summed over the chunks of one render."""
        e_pol = e_ref = kl = torch.zeros((), device=self.device)
        for ch, (sigma, eps) in zip(chunks, draws):
            xt, target = noisy_state(ch, sigma, eps)
            e_pol = e_pol + velocity_error(self.nets["dit"], ch, xt, target, sigma)
            with torch.no_grad():
                e_ref = e_ref + velocity_error(self.nets["anchor"], ch, xt, target, sigma)
            if self.cfg["kl"] > 0:
                free = ch.free_mask()
                v = denoiser_for(self.nets["dit"], ch)(xt, torch.tensor(sigma))
                with torch.no_grad():
                    v_ref = denoiser_for(self.nets["anchor"], ch)(xt, torch.tensor(sigma))
                kl = kl + ((v - v_ref).square() * free).sum() / free.sum()
        return e_pol, e_ref, kl

    def loss(self, g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        c = self.cfg
        parts, margins = [], []
        for _ in range(self.recipe["train"]["batch"]):
            pair = self.pairs[pick(g, len(self.pairs))]
            w, lo = self.record(pair["chosen"]), self.record(pair["rejected"])
            if len(w) != len(lo) or any(a.states[-1].shape != b.states[-1].shape for a, b in zip(w, lo)):
                raise InputError(f"{pair['chosen']} and {pair['rejected']}: not two renders of one condition "
                                 "(their chunks differ)")
            draws = [(flow_sigma(g, c["logit_mean"], c["logit_std"]), self.randn(g, *ch.states[-1].shape)) for ch in w]
            pw, rw, kw = self.errors(w, draws)
            pl, rl, kl = self.errors(lo, draws)
            delta = (pw - rw) - (pl - rl)
            parts.append(-F.logsigmoid(-c["beta"] * delta) + c["kl"] * (kw + kl))
            margins.append(-float(delta.detach()))
        loss = torch.stack(parts).mean()
        return loss, {"loss": float(loss.detach()), "margin": sum(margins) / len(margins),
                      "accuracy": sum(m > 0 for m in margins) / len(margins)}
