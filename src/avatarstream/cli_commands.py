"""`avatarstream models`, `verify` and `bench`: their options and what they print. cli.py imports
this module only when one of them runs; `bench NAME` imports that benchmark's module only."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json

from avatarstream.errors import ConfigError


# -- verify --------------------------------------------------------------------------------------
def configure_verify(p: argparse.ArgumentParser, rest: list[str]) -> None:
    p.add_argument("target", metavar="FILE|URL", help="a video file, an http(s) URL of one, or an "
                   "HLS playlist URL (.m3u8: the watermark only, HLS carries no manifest)")
    p.add_argument("--max-download-mb", type=float, default=2048.0,
                   help="stop when everything downloaded for a URL (its file, or a playlist and "
                   "its segments together) passes this many MB (default 2048)")
    p.add_argument("--header", "-H", action="append", default=[], metavar="'NAME: VALUE'",
                   help="send this header with a URL's requests (repeatable), e.g. a server "
                   "render's 'Authorization: Bearer KEY'; sent only to the URL's own scheme, "
                   "host and port (never to other hosts its playlist names or redirects to)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object last")
    from avatarstream.provenance.verify import add_limit_arguments

    add_limit_arguments(p)  # --timeout, --max-requests, --max-segments, --max-playlist-*
    p.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    from avatarstream.provenance.verify import describe, exit_code, limits_from, parse_headers, verify

    report = verify(args.target, limits=limits_from(args), headers=parse_headers(args.header))
    print("\n".join(describe(report)))
    if args.json:
        print(json.dumps(report))
    return exit_code(report)


# -- bench ---------------------------------------------------------------------------------------
def _static_help(modname: str) -> str:
    """A benchmark module's HELP string read from its source, without importing the module."""
    spec = importlib.util.find_spec(modname)
    if spec is None or spec.origin is None:
        return ""
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "HELP" for t in node.targets):
            try:
                return str(ast.literal_eval(node.value))
            except ValueError:
                return ""
    return ""


def configure_bench(p: argparse.ArgumentParser, rest: list[str]) -> None:
    """`bench NAME ...` imports only NAME's module; the others are listed with their HELP."""
    from avatarstream.bench import BENCHMARKS

    chosen = next((a for a in rest if not a.startswith("-")), None)
    bsub = p.add_subparsers(dest="bench", metavar="NAME", required=True)
    for name, modname in BENCHMARKS.items():
        if name != chosen:
            bsub.add_parser(name, help=_static_help(modname))
            continue
        mod = importlib.import_module(modname)
        bp = bsub.add_parser(name, help=mod.HELP, description=mod.HELP)
        bp.add_argument("--json", action="store_true", help="print only the JSON line")
        mod.add_arguments(bp)
        bp.set_defaults(func=cmd_module, cmd_module=mod)


def cmd_module(args: argparse.Namespace) -> int:
    """Run a subcommand module's `run(args)` and print its summary (`--json`: one JSON object last)."""
    result = args.cmd_module.run(args)
    if not args.json:
        for k, v in result.items():
            if k not in ("cases", "drift"):
                print(f"{k}: {v}")
    print(json.dumps(result, default=float))
    return 0


# -- models --------------------------------------------------------------------------------------
def _sub(sub: argparse._SubParsersAction, name: str, help_: str) -> argparse.ArgumentParser:
    """A sub-command whose --help says what it does."""
    return sub.add_parser(name, help=help_, description=help_)


def configure_models(p: argparse.ArgumentParser, rest: list[str]) -> None:
    """`models` alone lists them, as `models list` does."""
    p.set_defaults(func=cmd_models)
    msub = p.add_subparsers(dest="models_command", metavar="COMMAND")
    pl = _sub(msub, "list", "list the models you can pass to --model (also `models` alone)")
    pl.set_defaults(func=cmd_models)
    pp = _sub(msub, "parity", "run our port on a parity fixture of the official code "
              "(docs/parity-fixtures.md); exit 1 when it is off by more than the tolerance")
    pp.add_argument("fixture", help="a .safetensors fixture (format avatarstream-parity/1)")
    pp.add_argument("--tolerance", type=float, default=None, help="max abs difference (default: the "
                    "family's bound, 1e-5 to 3e-5, about 4x what our ports measure)")
    pp.add_argument("--json", action="store_true", help="print only the JSON line")
    pp.set_defaults(func=cmd_models_parity)
    pc = _sub(msub, "check", "check a downloaded checkpoint folder from its file headers (no "
              "tensor is read): family, keys and shapes, sizes, memory needed; exit 1 when "
              "something is missing or wrong")
    pc.add_argument("folder", help="SoulX-FlashHead-1_3B, one of its subfolders, wav2vec2-base-960h, a LiveAvatar "
                    "download (the folder holding Wan2.2-S2V-14B/ and LiveAvatar/, or either), or a folder holding them")
    pc.add_argument("--json", action="store_true", help="print only the JSON line")
    pc.set_defaults(func=cmd_models_check)
    pe = _sub(msub, "encode-text", "run Wan's umT5-XXL text encoder once on a prompt and write "
              "its [L, 4096] context file (the DiT reads it; it never loads the encoder)")
    pe.add_argument("--prompt", required=True, help="the text the video should follow")
    pe.add_argument("--out", required=True, help="the context file to write (.safetensors)")
    pe.add_argument("--ckpt", help="a Wan2.2-S2V-14B folder (or the folder holding it): finds both below")
    pe.add_argument("--t5", help="models_t5_umt5-xxl-enc-bf16.pth (default: in --ckpt)")
    pe.add_argument("--tokenizer", help="the google/umt5-xxl tokenizer folder (default: in --ckpt)")
    pe.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="compute and store dtype (default bfloat16, as Wan runs it)")
    pe.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    pe.add_argument("--json", action="store_true", help="print only the JSON line")
    pe.set_defaults(func=cmd_models_encode_text)
    from avatarstream import cli_compile  # `models compile`: its own module

    cli_compile.add_arguments(_sub(msub, "compile", cli_compile.HELP))
    from avatarstream.weights.tiny_cli import add_arguments as add_tiny  # `models tiny`: its own module

    add_tiny(msub)


def cmd_models_parity(args: argparse.Namespace) -> int:
    from avatarstream.parity.fixture import run_parity

    result = run_parity(args.fixture, tolerance=args.tolerance)
    if not args.json:
        for name, diff in result["outputs"].items():
            print(f"{name}: max abs diff {diff:.3g}")
        print(f"{result['family']}: {'pass' if result['pass'] else 'FAIL'} "
              f"(max abs diff {result['max_abs_diff']:.3g}, tolerance {result['tolerance']:g})")
    print(json.dumps({k: v for k, v in result.items() if k != "outputs"}))
    return 0 if result["pass"] else 1


def cmd_models_check(args: argparse.Namespace) -> int:
    from avatarstream.weights.check import check_folder, describe

    report = check_folder(args.folder)
    if not args.json:
        print(describe(report))
    print(json.dumps(report))
    return 0 if report["ok"] else 1


def cmd_models_encode_text(args: argparse.Namespace) -> int:
    import torch

    from avatarstream.hardware import check_device
    from avatarstream.weights.umt5 import encode_text, locate

    check_device(args.device)
    if args.ckpt is None and (args.t5 is None or args.tokenizer is None):
        raise ConfigError("give --ckpt (a Wan2.2-S2V-14B folder), or both --t5 and --tokenizer")
    t5, tokenizer = locate(args.ckpt) if args.ckpt is not None else (None, None)
    result = encode_text(args.prompt, t5=args.t5 or t5, tokenizer=args.tokenizer or tokenizer, out=args.out,
                         dtype=getattr(torch, args.dtype), device=args.device)
    if not args.json:
        print(f"wrote {result['out']}: {result['tokens']} tokens x {result['dim']} ({result['dtype']})"
              + (", prompt truncated to 512 tokens" if result["truncated"] else ""))
    print(json.dumps(result))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from avatarstream.registry import MODELS

    for name, spec in sorted(MODELS.items()):
        print(f"{name:16s} {spec.description}")
    return 0


# subcommands whose module exposes add_arguments(parser) and run(args) -> summary dict
