"""Train the three experts on synthetic data from `avatarstream.data` (train split only).

    python -m avatarstream.eval.train_experts --out RUN --stage face_state --steps 2000 --minutes 10
    python -m avatarstream.eval.train_experts --out RUN --stage identity --steps 2500 --minutes 7
    python -m avatarstream.eval.train_experts --out RUN --stage sync --steps 2600 --minutes 14
    python -m avatarstream.eval.train_experts --out RUN --stage export

(the three training stages are independent: run them in parallel processes if cores allow).

Each stage renders its own data pool once (saved as OUT/pool_STAGE.pt), trains single-threaded,
checkpoints to OUT/STAGE.ckpt every `--ckpt-every` seconds and resumes from it when restarted
(killing a run loses at most that much). `export` copies the three weight sets to
`--export-dir` (default the bundled `assets/experts/`) as safetensors and validates each expert
on held-out identities / voices, writing OUT/validation.json.

Identities come from `identity_seeds(MASTER, n, "train")` and voices from `voices_for("train")`:
held-out identities and voices are never drawn. Annotations (mouth position, pose, mouth
opening) are the training targets and locate training crops; evaluation never reads them.

Independent experts (evaluation-only experts that a reward built on the bundled ones never saw):
another `--seed-base` and `--seed`, and `--exclude-base` naming the recipe whose identities must
not be drawn (the bundled one: 4242, seed 0, default pool sizes); every draw skips them, and
`disjointness()` checks the two recipes share no identity and no sync clip seed or scene:

    python -m avatarstream.eval.train_experts --out RUN --stage identity --seed-base 5151 --seed 1 \\
        --exclude-base 4242 --steps 2500 --minutes 7
    (the same with --stage sync --steps 2600 --minutes 15, then --stage export --export-dir DIR)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from avatarstream.data import AvatarRenderer, Clip, ClipSpec, Identity, Scene, identity_seeds
from avatarstream.data.splits import derive_seed, voices_for
from avatarstream.eval.experts import (ASSET_DIR, FACE_SIZE, MOUTH_SIZE, POSE_SCALE, SYNC_SIZE, FaceStateNet,
                                       IdentityNet, SyncNet, audio_mel, crop, face_box, grey, mel_windows,
                                       mouth_box, to_canvas)
from avatarstream.eval.face_states import random_state

MASTER = 4242  # master seed of the experts' training identities (the bundled recipe)
POOL_SIZES = {"face_ids": 700, "identity_ids": 1500, "sync_clips": 110}  # the bundled recipe's pools
VSHIFT = 15
NEG = 7  # random shifted negatives per sample (besides one near shift)


def degrade(x: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """Random blur (down/up-sampling), colour gain and noise, so the experts also read the softer
    frames a generator produces. x [N, 3, 256, 256] in [0, 1]."""
    if rng.random() < 0.35:
        s = int(rng.choice([64, 96, 128, 160]))
        x = F.interpolate(F.interpolate(x, size=(s, s), mode="area"), size=x.shape[-2:], mode="bilinear",
                          align_corners=False)
    gain = torch.from_numpy(rng.uniform(0.85, 1.15, (x.shape[0], 3, 1, 1)).astype(np.float32))
    x = x * gain + float(rng.uniform(-0.05, 0.05))
    if rng.random() < 0.3:
        x = x + torch.randn_like(x) * float(rng.uniform(0, 0.03))
    return x.clamp(0, 1)


def _jitter(rng: np.random.Generator, n: int, pos: float, scl: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (rng.uniform(-pos, pos, n).astype(np.float32), rng.uniform(-pos, pos, n).astype(np.float32),
            np.exp(rng.uniform(-scl, scl, n)).astype(np.float32))


# -- pools ---------------------------------------------------------------------------------------
def draw_identities(master: int, n: int, exclude: frozenset[int] = frozenset(), split: str = "train") -> list[int]:
    """`identity_seeds(master, ...)` with the seeds in `exclude` skipped: the first `n` of the
    draw that are not excluded (with an empty `exclude`, exactly `identity_seeds(master, n)`)."""
    if not exclude:
        return identity_seeds(master, n, split)
    out = [s for s in identity_seeds(master, n + len(exclude), split) if s not in exclude][:n]
    assert len(out) == n
    return out


def recipe_draws(base: int = MASTER, seed: int = 0, exclude: frozenset[int] = frozenset(),
                 face_ids: int = POOL_SIZES["face_ids"], identity_ids: int = POOL_SIZES["identity_ids"],
                 sync_clips: int = POOL_SIZES["sync_clips"]) -> dict[str, list[int]]:
    """The identity seeds each stage of a recipe trains on, and its sync clips' seeds (a sync clip's
    seed also draws its scene, sentences and motion): what `face_pool`, `identity_pool` and
    `sync_pool` draw for these arguments, without rendering anything."""
    sync_ids = draw_identities(base + 13 + seed, sync_clips, exclude)
    return {"face_state": draw_identities(base + seed, face_ids, exclude),
            "identity": draw_identities(base + 7 + seed, identity_ids, exclude),
            "sync": sync_ids,
            "sync_clip_seeds": [derive_seed(base + 13 + seed, i, "sync", k) for k, i in enumerate(sync_ids)]}


def recipe_exclusion(base: int | None, seed: int = 0) -> frozenset[int]:
    """Every identity the recipe (`base`, `seed`, bundled pool sizes) trained any expert on; empty for None."""
    if base is None:
        return frozenset()
    d = recipe_draws(base, seed)
    return frozenset(d["face_state"]) | frozenset(d["identity"]) | frozenset(d["sync"])


def disjointness(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict[str, int]:
    """Overlap counts between two recipes' draws (all zero when they are disjoint): identities
    (any stage of one against any stage of the other), sync clip seeds and sync scenes."""
    ids = lambda d: set(d["face_state"]) | set(d["identity"]) | set(d["sync"])  # noqa: E731
    scenes = lambda d: {c % 1_000_000 for c in d["sync_clip_seeds"]}  # noqa: E731
    clips = set(a["sync_clip_seeds"]) & set(b["sync_clip_seeds"])
    return {"identities": len(ids(a) & ids(b)), "sync_clip_seeds": len(clips), "sync_scenes": len(scenes(a) & scenes(b))}


def face_pool(n_ids: int, per_id: int, seed: int, base: int = MASTER, exclude: frozenset[int] = frozenset()
              ) -> dict[str, torch.Tensor]:
    """Rendered training samples for the face-state net: loc [N, 3, 96, 96] uint8, face crops
    [N, 3, 64, 64] and mouth crops [N, 3, 48, 48] uint8 (jittered boxes), targets [N, 10]."""
    rng = np.random.default_rng(seed)
    locs, faces, mouths, ys = [], [], [], []
    for ident in draw_identities(base + seed, n_ids, exclude):
        r = AvatarRenderer(Identity.from_seed(ident), Scene.from_seed(int(rng.integers(1 << 30))))
        sts = [random_state(rng) for _ in range(per_id)]
        x = to_canvas(np.stack([r.render(s) for s in sts]))
        x = degrade(x, rng)
        mxy = torch.tensor([r.mouth_xy(s) for s in sts], dtype=torch.float32)
        a = torch.full((per_id,), float(r.rig.a))
        dx, dy, ds = (torch.from_numpy(v) for v in _jitter(rng, per_id, 0.08, 0.12))
        mx, my = mxy[:, 0] + dx * a, mxy[:, 1] + dy * a
        fb = face_box(mx, my, a * ds)
        mb = mouth_box(mxy[:, 0] + dx * a * 0.5, mxy[:, 1] + dy * a * 0.5, a * ds)
        locs.append(F.interpolate(x, size=(96, 96), mode="area"))
        faces.append(crop(x, *fb, FACE_SIZE))
        mouths.append(crop(x, *mb, MOUTH_SIZE))
        ys.append(torch.tensor([[mxy[i, 0] / 256 - 0.5, mxy[i, 1] / 256 - 0.5, np.log(r.rig.a / 50.0),
                                 s.yaw / POSE_SCALE, s.pitch / POSE_SCALE, s.roll / POSE_SCALE, s.blink,
                                 s.open, s.width, s.round] for i, s in enumerate(sts)], dtype=torch.float32))
    u8 = lambda t: (torch.cat(t) * 255).round().clamp(0, 255).to(torch.uint8)  # noqa: E731
    return {"loc": u8(locs), "face": u8(faces), "mouth": u8(mouths), "y": torch.cat(ys)}


def identity_pool(n_ids: int, views: int, seed: int, base: int = MASTER, exclude: frozenset[int] = frozenset()
                  ) -> dict[str, torch.Tensor]:
    """faces [n_ids, views, 3, 64, 64] uint8: each view a different scene and face state."""
    rng = np.random.default_rng(seed + 1)
    out = []
    for ident in draw_identities(base + 7 + seed, n_ids, exclude):
        idn = Identity.from_seed(ident)
        vs = []
        for _ in range(views):
            r = AvatarRenderer(idn, Scene.from_seed(int(rng.integers(1 << 30))))
            s = random_state(rng)
            x = degrade(to_canvas(r.render(s)[None]), rng)
            mx, my = (torch.tensor([v], dtype=torch.float32) for v in r.mouth_xy(s))
            dx, dy, ds = (torch.from_numpy(v) for v in _jitter(rng, 1, 0.08, 0.12))
            a = torch.tensor([float(r.rig.a)])
            vs.append(crop(x, *face_box(mx + dx * a, my + dy * a, a * ds), FACE_SIZE)[0])
        out.append(torch.stack(vs))
    return {"faces": (torch.stack(out) * 255).round().clamp(0, 255).to(torch.uint8)}


def sync_clip(spec: ClipSpec, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """One rendered clip for the sync net: grey mouth crops [F, 1, 40, 40] uint8 (GT location with a
    per-clip offset and per-frame jitter), mel windows [F, 1, 40, 20], speaking flags [F]."""
    clip = Clip(spec)
    pf = clip.annotations["per_frame"]
    x = degrade(to_canvas(clip.frames()), rng)
    n = x.shape[0]
    a = float(clip.renderer.rig.a)
    ox, oy, os_ = (float(v[0]) for v in _jitter(rng, 1, 0.06, 0.1))
    mx = torch.tensor(pf["mouth_x"]) + a * ox + torch.from_numpy(rng.normal(0, 0.6, n).astype(np.float32))
    my = torch.tensor(pf["mouth_y"]) + a * oy + torch.from_numpy(rng.normal(0, 0.6, n).astype(np.float32))
    side = torch.full((n,), a * os_) * 2.2
    m = grey(crop(x, mx, my, side, SYNC_SIZE))
    return {"mouth": (m * 255).round().to(torch.uint8), "mel": mel_windows(audio_mel(clip.audio), n),
            "speaking": torch.tensor(pf["speaking"])}


def sync_pool(n_clips: int, seconds: float, seed: int, split: str = "train", master: int | None = None,
              base: int = MASTER, exclude: frozenset[int] = frozenset()) -> list[dict[str, torch.Tensor]]:
    rng = np.random.default_rng(seed + 2)
    master = base + 13 + seed if master is None else master
    voices = voices_for(split)
    out = []
    for k, ident in enumerate(draw_identities(master, n_clips, exclude, split)):
        cs = derive_seed(master, ident, "sync", k)
        spec = ClipSpec(identity=ident, scene=cs % 1_000_000, voice=voices[cs % len(voices)].id, seed=cs,
                        seconds=seconds, split=split)
        out.append(sync_clip(spec, rng))
    return out


# -- training ------------------------------------------------------------------------------------
class Trainer:
    """Checkpointed loop: `step_fn(step) -> loss` until `minutes` or `steps` (the LR schedule follows
    whichever budget runs out first); resumes from OUT/STAGE.ckpt."""

    def __init__(self, out: Path, stage: str, net: torch.nn.Module, lr: float, steps: int, minutes: float,
                 ckpt_every: float) -> None:
        self.out, self.stage, self.net = out, stage, net
        self.opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=1e-4)
        self.lr = lr
        self.steps, self.minutes, self.ckpt_every = steps, minutes, ckpt_every
        self.step, self.elapsed = 0, 0.0
        self.path = out / f"{stage}.ckpt"
        if self.path.exists():
            ck = torch.load(self.path, weights_only=False)
            net.load_state_dict(ck["net"])
            self.opt.load_state_dict(ck["opt"])
            self.step, self.elapsed = ck["step"], ck["elapsed"]
            print(f"[{stage}] resumed at step {self.step} ({self.elapsed:.0f} s)", flush=True)

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        torch.save({"net": self.net.state_dict(), "opt": self.opt.state_dict(),
                    "step": self.step, "elapsed": self.elapsed}, tmp)
        tmp.replace(self.path)

    def run(self, step_fn) -> None:  # type: ignore[no-untyped-def]
        t0, last, losses = time.perf_counter() - self.elapsed, time.perf_counter(), []
        self.net.train()
        while self.step < self.steps and (time.perf_counter() - t0) < self.minutes * 60:
            # progress by steps or by the time budget, whichever is further: warm-up, then cosine
            # decay that ends when either budget does (a shared CPU makes step times unpredictable)
            prog = max(self.step / self.steps, (time.perf_counter() - t0) / (self.minutes * 60))
            f = min(1.0, prog / 0.03) * (0.02 + 0.98 * 0.5 * (1 + np.cos(np.pi * min(prog, 1.0))))
            for grp in self.opt.param_groups:
                grp["lr"] = self.lr * f
            loss = step_fn(self.step)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), 2.0)
            self.opt.step()
            self.step += 1
            losses.append(float(loss.detach()))
            if time.perf_counter() - last > self.ckpt_every:
                self.elapsed = time.perf_counter() - t0
                self.save()
                last = time.perf_counter()
                print(f"[{self.stage}] step {self.step}/{self.steps} loss {np.mean(losses[-50:]):.4f} "
                      f"{self.elapsed:.0f} s", flush=True)
        self.elapsed = time.perf_counter() - t0
        self.save()
        (self.out / f"{self.stage}.done").write_text(json.dumps({"step": self.step, "seconds": round(self.elapsed, 1)}))
        print(f"[{self.stage}] finished at step {self.step} after {self.elapsed:.0f} s", flush=True)


def _pool(out: Path, name: str, make):  # type: ignore[no-untyped-def]
    p = out / f"pool_{name}.pt"
    if p.exists():
        return torch.load(p, weights_only=False)
    t = time.perf_counter()
    pool = make()
    torch.save(pool, p)
    print(f"[{name}] pool rendered in {time.perf_counter() - t:.0f} s", flush=True)
    return pool


def train_face(out: Path, args: argparse.Namespace) -> None:
    pool = _pool(out, "face_state", lambda: face_pool(args.face_ids, 8, args.seed, args.seed_base, args.exclude))
    net = FaceStateNet()
    n = pool["y"].shape[0]
    g = torch.Generator().manual_seed(args.seed)

    def step(_: int) -> torch.Tensor:
        i = torch.randint(0, n, (args.batch,), generator=g)
        y = pool["y"][i]
        loc = net.loc_out(net.locator(pool["loc"][i].float() / 255))
        fs = net.face_out(net.face(pool["face"][i].float() / 255))
        ms = net.mouth_out(net.mouth(pool["mouth"][i].float() / 255))
        return (F.smooth_l1_loss(loc * 20, y[:, :3] * 20, beta=0.1) + F.smooth_l1_loss(fs, y[:, 3:7], beta=0.05)
                + 2 * F.smooth_l1_loss(ms, y[:, 7:], beta=0.05))

    Trainer(out, "face_state", net, 3e-3, args.steps, args.minutes, args.ckpt_every).run(step)


def train_identity(out: Path, args: argparse.Namespace) -> None:
    pool = _pool(out, "identity", lambda: identity_pool(args.identity_ids, 3, args.seed, args.seed_base,
                                                   args.exclude))["faces"]
    net = IdentityNet()
    n, v = pool.shape[:2]
    g = torch.Generator().manual_seed(args.seed + 1)
    logit_scale = 14.0

    def step(_: int) -> torch.Tensor:
        ids = torch.randperm(n, generator=g)[: args.batch // 2]
        pair = torch.stack([torch.randperm(v, generator=g)[:2] for _ in range(len(ids))])  # [B, 2]
        a = net(pool[ids, pair[:, 0]].float() / 255)
        b = net(pool[ids, pair[:, 1]].float() / 255)
        logits = logit_scale * a @ b.T
        t = torch.arange(len(ids))
        return 0.5 * (F.cross_entropy(logits, t) + F.cross_entropy(logits.T, t))

    Trainer(out, "identity", net, 3e-3, args.steps, args.minutes, args.ckpt_every).run(step)


def _sync_batch(clips: list[dict[str, torch.Tensor]], b: int, g: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Video windows [b, 5, 40, 40] and audio windows [b, 2 + NEG, 1, 40, 20]: index 0 aligned, then
    shifted windows of the same clip; positions mostly in speech and away from the ends."""
    vs, aus = [], []
    others = torch.cat([torch.arange(-VSHIFT, 0), torch.arange(1, VSHIFT + 1)])
    for _ in range(b):
        c = clips[int(torch.randint(0, len(clips), (1,), generator=g))]
        n = c["mouth"].shape[0]
        sp = torch.nonzero(c["speaking"][VSHIFT:n - VSHIFT]).flatten() + VSHIFT
        if len(sp) and torch.rand(1, generator=g) < 0.85:
            t = int(sp[torch.randint(0, len(sp), (1,), generator=g)])
        else:
            t = int(torch.randint(VSHIFT, n - VSHIFT, (1,), generator=g))
        idx = (t + torch.arange(-2, 3)).clamp(0, n - 1)
        vs.append(c["mouth"][idx, 0])
        # aligned first, then 1-2 near shifts (±1..3) and 6 random ones: index 0 is the positive
        near = torch.tensor([int(torch.randint(1, 4, (1,), generator=g)) * (1 if torch.rand(1, generator=g) < 0.5 else -1)])
        offs = torch.cat([torch.zeros(1, dtype=torch.long), near, others[torch.randperm(len(others), generator=g)[:NEG]]])
        aus.append(c["mel"][(t + offs).clamp(0, n - 1)])
    return torch.stack(vs).float() / 255, torch.stack(aus)


def train_sync(out: Path, args: argparse.Namespace) -> None:
    clips = _pool(out, "sync", lambda: sync_pool(args.sync_clips, args.sync_seconds, args.seed, base=args.seed_base,
                                                 exclude=args.exclude))
    net = SyncNet()
    mel = torch.cat([c["mel"][:, 0].permute(1, 0, 2).reshape(40, -1) for c in clips[:20]], 1)
    net.mel_mean.copy_(mel.mean(1, keepdim=True))
    net.mel_std.copy_(mel.std(1, keepdim=True).clamp_min(0.5))
    g = torch.Generator().manual_seed(args.seed + 2)
    scale = 10.0

    def step(_: int) -> torch.Tensor:
        v, a = _sync_batch(clips, args.batch // 2, g)
        b, k = a.shape[:2]
        ev = net.embed_video(v)  # [b, d]
        ea = net.embed_audio(a.reshape(b * k, *a.shape[2:])).reshape(b, k, -1)  # [b, k, d]
        own = scale * torch.einsum("bd,bkd->bk", ev, ea)  # [b, k]: offsets of the same clip
        cross = scale * ev @ ea[:, 0].T  # [b, b]: aligned audio of the other samples
        cross = cross.masked_fill(torch.eye(b, dtype=torch.bool), float("-inf"))
        logits = torch.cat([own, cross], 1)
        return F.cross_entropy(logits, torch.zeros(b, dtype=torch.long))

    Trainer(out, "sync", net, 2e-3, args.steps, args.minutes, args.ckpt_every).run(step)


# -- export and validation -----------------------------------------------------------------------
def export(out: Path, dest: Path) -> dict[str, Any]:
    """Write the trained weights as safetensors into `dest` (the stages that have a checkpoint: an
    independent run trains sync and identity only and shares the bundled face_state); returns
    validation numbers."""
    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    for name, cls in (("face_state", FaceStateNet), ("sync", SyncNet), ("identity", IdentityNet)):
        if not (out / f"{name}.ckpt").exists():
            continue
        net = cls()
        net.load_state_dict(torch.load(out / f"{name}.ckpt", weights_only=False)["net"])
        # float16 on disk (the three fit in 3 MB); load_state_dict casts back to float32
        save_file({k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in net.state_dict().items()},
                  str(dest / f"{name}.safetensors"))
    from avatarstream.eval.validate import validate_experts

    val = validate_experts(dest)
    val["training"] = {s: json.loads((out / f"{s}.done").read_text()) for s in ("face_state", "identity", "sync")
                       if (out / f"{s}.done").exists()}
    (out / "validation.json").write_text(json.dumps(val, indent=1))
    return val


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m avatarstream.eval.train_experts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="run folder: pools, checkpoints, validation.json")
    p.add_argument("--stage", choices=["face_state", "identity", "sync", "all", "export"], default="all")
    p.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget per stage")
    p.add_argument("--steps", type=int, default=3000, help="optimizer steps per stage (LR schedule length)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="weight init, scenes, jitter, batches; offsets the draws")
    p.add_argument("--seed-base", type=int, default=MASTER, help="master seed of the identity and clip draws")
    p.add_argument("--exclude-base", type=int, help="never draw an identity that the recipe with this seed base "
                   "(and --exclude-seed, bundled pool sizes) trained on: 4242 for the bundled experts")
    p.add_argument("--exclude-seed", type=int, default=0)
    p.add_argument("--face-ids", type=int, default=700)
    p.add_argument("--identity-ids", type=int, default=1500)
    p.add_argument("--sync-clips", type=int, default=110)
    p.add_argument("--sync-seconds", type=float, default=6.0)
    p.add_argument("--ckpt-every", type=float, default=45.0, help="seconds between checkpoints")
    p.add_argument("--export-dir", default=str(ASSET_DIR))
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.exclude = recipe_exclusion(args.exclude_base, args.exclude_seed)
    if args.exclude and args.stage != "export":
        mine = recipe_draws(args.seed_base, args.seed, args.exclude, args.face_ids, args.identity_ids, args.sync_clips)
        overlap = disjointness(mine, recipe_draws(args.exclude_base, args.exclude_seed))
        print(f"disjointness from base {args.exclude_base}: overlaps {overlap}", flush=True)
        if overlap["identities"] or overlap["sync_clip_seeds"]:
            raise SystemExit(f"draws overlap the excluded recipe: {overlap}")
    stages = ["face_state", "identity", "sync"] if args.stage == "all" else [args.stage]
    for s in stages:
        if s == "export":
            print(json.dumps(export(out, Path(args.export_dir))))
        elif not (out / f"{s}.done").exists():
            {"face_state": train_face, "identity": train_identity, "sync": train_sync}[s](out, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
