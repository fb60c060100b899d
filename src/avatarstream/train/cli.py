"""`avatarstream train`: run a recipe, pre-encode data, export weights.

    avatarstream train RECIPE [--resume] [--run-dir DIR] [--max-steps N] [--device cpu|cuda]
                              [--set section.key=value ...] [--no-progress]
                              [--nproc N] [--shard auto|ddp|fsdp] [--micro-batches M]
        (also `torchrun --nproc-per-node N -m avatarstream.cli train RECIPE ...`: train/distributed.py)
    avatarstream train prepare --shards SYNTH_DIR --vae VAE_RUN|WEIGHTS|random --model tiny|small
                               --out FILE.safetensors [--max-clips N] [--device cpu|cuda]
    avatarstream train export RUN_DIR [RUN_DIR ...] --out weights/NAME/ [--steps K]
    avatarstream train personality --base MODEL --footage DIR [--out FILE] [--steps N] [--rank R]
                                   [--resume] (a LoRA for one person: train/personality.py)
    avatarstream train grpo RECIPE [options of RECIPE]   (feedback alignment: rewards on rollouts)
    avatarstream train dpo RECIPE [options of RECIPE]    (preference pairs: annotate export / auto)
    avatarstream train pairs --out PAIRS [--model M] [--conditions N] (renders for annotate / dpo)

Each returns a JSON-serialisable summary (the top-level CLI prints it).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from avatarstream.errors import ConfigError

USAGE = __doc__.split("\n\n")[1]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose mistakes are ConfigErrors (one-line message, exit code 2)."""

    def error(self, message: str):  # type: ignore[override]
        raise ConfigError(f"{self.prog}: {message}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", metavar="RECIPE|grpo|dpo|pairs|prepare|export|personality",
                   help="a recipe (.toml path or name under recipes/), `grpo RECIPE` / `dpo RECIPE`, or "
                        "`pairs` / `prepare` / `export` / `personality`")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of that form (see above)")


def _run_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="avatarstream train RECIPE", add_help=False)
    p.add_argument("--resume", action="store_true",
                   help="continue from the run folder's last checkpoint (with --set train.steps=N: lengthen it)")
    p.add_argument("--run-dir", default=None, help="run folder (default runs/<recipe name>)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop (with a checkpoint) after this many steps in total; the schedule stays the recipe's")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a recipe value (TOML syntax)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--nproc", type=int, default=0,
                   help="train data-parallel on N processes here (starts torchrun --standalone)")
    p.add_argument("--shard", default="auto", choices=["auto", "ddp", "fsdp"],
                   help="under torchrun: DDP, or FSDP2 sharding (auto: fsdp when a DiT trains)")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="draw the global batch as M micro-batches (default: one per process)")
    return p


def _prepare_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="avatarstream train prepare", add_help=False)
    p.add_argument("--shards", required=True)
    p.add_argument("--vae", required=True, help="vae run folder, weights folder/.safetensors, or `random` (tests)")
    p.add_argument("--model", choices=["tiny", "small"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-clips", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-progress", action="store_true")
    return p


def _export_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="avatarstream train export", add_help=False)
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--prepared", default=None,
                   help="prepared file whose VAE to bundle (default: the one the runs trained on)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="storage dtype")
    p.add_argument("--share-with", default=None, metavar="FOLDER",
                   help="a weights folder: networks byte-identical to its files are referred to, not copied")
    p.add_argument("--steps", type=int, default=None,
                   help="the model's default denoising steps (default: the preset's; pick it from "
                        "`eval card --sweep-steps`)")
    return p


def _parse(parser: argparse.ArgumentParser, rest: list[str]) -> argparse.Namespace:
    # `train FORM --help` shows that form's options (before its required ones are missed)
    parser.add_argument("-h", "--help", action="help", help="show this help message and exit")
    ns, extra = parser.parse_known_args(rest)
    if extra:
        raise ConfigError(f"{parser.prog}: unrecognised arguments: {' '.join(extra)}")
    return ns


def run(args: argparse.Namespace) -> dict[str, Any]:
    if "--json" in args.rest:  # `train RECIPE ... --json`: the top-level flag after the recipe
        args.rest = [a for a in args.rest if a != "--json"]
        args.json = True
    if args.recipe == "prepare":
        return _prepare(_parse(_prepare_parser(), args.rest))
    if args.recipe == "personality":
        from avatarstream.train import personality

        return personality.run(_parse(personality.parser(_Parser), args.rest))
    if args.recipe == "export":
        from avatarstream.train.export import export

        ns = _parse(_export_parser(), args.rest)
        return export(ns.runs, ns.out, prepared=ns.prepared, dtype=ns.dtype, steps=ns.steps,
                      share_with=ns.share_with)
    if args.recipe == "pairs":
        from avatarstream.train import pairs

        return pairs.run(_parse(pairs.parser(_Parser), args.rest))
    stage = None
    if args.recipe in ("grpo", "dpo"):  # `train grpo RECIPE`: the recipe must be of that stage
        if not args.rest or args.rest[0].startswith("-"):
            raise ConfigError(f"avatarstream train {args.recipe}: name a recipe (e.g. {args.recipe}-small)")
        stage, args.recipe, args.rest = args.recipe, args.rest[0], args.rest[1:]
    ns = _parse(_run_parser(), args.rest)
    from avatarstream.train.recipe import load_recipe
    from avatarstream.train.trainer import Trainer

    recipe = load_recipe(args.recipe, ns.set)
    if stage is not None and recipe["stage"] != stage:
        raise ConfigError(f"avatarstream train {stage}: {args.recipe} is a {recipe['stage']!r} recipe")
    if ns.max_steps is not None and ns.max_steps < 1:
        raise ConfigError("--max-steps must be at least 1")
    if ns.nproc:  # checked here first: a bad recipe is one message, not one a rank
        from avatarstream.train.distributed import check_split
        from avatarstream.train.launch import launch, without_nproc

        check_split(recipe["train"]["batch"], ns.micro_batches or ns.nproc, ns.nproc)
        return launch(ns.nproc, args.recipe, without_nproc(args.rest))
    run_dir = Path(ns.run_dir) if ns.run_dir else Path("runs") / recipe["name"]
    from avatarstream.train.distributed import group

    with group(ns.device) as device:
        return Trainer(recipe, run_dir, device=device, max_steps=ns.max_steps, progress=not ns.no_progress,
                       shard=ns.shard, micro_batches=ns.micro_batches).run(resume=ns.resume)


def _prepare(ns: argparse.Namespace) -> dict[str, Any]:
    from avatarstream.train.data import prepare
    from avatarstream.train.checkpoints import net_weights
    from avatarstream.train.nets import GEOMETRY, build_nets, vae_for
    from avatarstream.train.trainer import resolve_device

    device = resolve_device(ns.device)
    vae = build_nets(ns.model)["vae"]
    if ns.vae == "random":
        vae.init_random_(0)  # random features (tests), not the pooling init of training
    else:
        try:
            vae = vae_for(ns.model, net_weights(ns.vae, "vae"))
        except RuntimeError as e:
            raise ConfigError(f"--vae {ns.vae}: not a {ns.model} VAE ({str(e).splitlines()[0]})") from None
    g = GEOMETRY[ns.model]
    return prepare(ns.shards, vae, ns.out, lr_size=g["lr_size"], hr_size=g["hr_size"],
                   max_clips=ns.max_clips or None, device=str(device), progress=not ns.no_progress,
                   fold=not _already_folded(ns.vae))


def _already_folded(source: str) -> bool:
    """Whether a --vae source's VAE has latent statistics folded in: an exported weights folder
    or a prepared file (a VAE run folder or a bare VAE file: not yet)."""
    p = Path(source)
    if p.is_dir():
        return (p / "config.json").is_file()
    if p.is_file() and p.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(p), "pt") as f:
            return "avatarstream" in (f.metadata() or {}) and any(k.startswith("vae.") for k in f.keys())
    return False
