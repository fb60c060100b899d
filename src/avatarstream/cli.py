"""Command line: entry points only. Library code never prints; this module does.

Each command's module is imported only when that command runs (`avatarstream generate` loads no
training, data, benchmark or evaluation code); the list below holds every command's help, so
`avatarstream --help` imports none of them.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time

from avatarstream.errors import AvatarStreamError, ConfigError
from avatarstream.publish import interrupt

log = logging.getLogger("avatarstream")

# name -> (module, configure, help). `configure(parser, rest)` (rest: the words after the command)
# adds the command's options and the function that runs it; without one, the module exposes
# add_arguments(parser) and run(args) -> summary dict (printed by `cmd_module`), and its `USAGE`,
# when it has one, is the command's description.
COMMANDS: dict[str, tuple[str, str | None, str]] = {
    "generate": ("avatarstream.cli_generate", "configure",
                 "reference + speech -> video of the person speaking (streamed to the file)"),
    "batch": ("avatarstream.batch.cli", "configure", "one video per row of a CSV/JSONL/Parquet file, on Ray: "
              "resumable, one model load per worker, a laptop or a cluster (docs/batch.md)"),
    "bench": ("avatarstream.cli_commands", "configure_bench",
              "benchmarks; each prints one JSON object on its last line"),
    "models": ("avatarstream.cli_commands", "configure_models",
               "list the models you can pass to --model (`models` or `models list`); parity and "
               "download checks"),
    "verify": ("avatarstream.cli_commands", "configure_verify",
               "is a video marked as AI-generated? reads its content credentials (C2PA) and its "
               "invisible watermark; exit 0 marked by either, 1 by neither, 2 unreadable input"),
    "synth": ("avatarstream.data.cli", None, "render synthetic talking-head clips with exact ground truth"),
    "curate": ("avatarstream.data.curate.cli", None, "real footage -> training shards on Ray Data: shots, "
               "face tracks, head crops, filters, identities, cross-scene pairs (needs "
               "avatarstream[real,curate])"),
    "train": ("avatarstream.train.cli", None, "train a recipe, pre-encode training data, export weights"),
    "eval": ("avatarstream.eval.cli", None, "score a video (Sync-C/D, FaceSim, style, silence, seams, "
             "PSNR) or benchmark a model on held-out synthetic cases"),
    "annotate": ("avatarstream.annotate.cli", None, "people judge pairs of renders on a local web page; "
                 "export their (or the reward's) preferences for Diffusion-DPO"),
    "serve": ("avatarstream.serve.cli", None, "live avatar sessions server: WebRTC, WebSocket speech, "
              "TTS, HLS, renders, web page"),
    "client": ("avatarstream.serve.client", None, "open a live session as the web page does (WebRTC), "
               "record it, report ttff/fps/av offset"),
    "livekit": ("avatarstream.serve.livekit.cli", None, "avatar worker for LiveKit rooms: joins rooms on "
                "dispatch, speaks an agent's audio (needs avatarstream[livekit])"),
}


def _add_command(sub: argparse._SubParsersAction, name: str, rest: list[str]) -> None:
    """The parser of command `name`, its module imported."""
    modname, configure, help_ = COMMANDS[name]
    try:
        mod = importlib.import_module(modname)
    except ImportError as e:
        raise ConfigError(f"`avatarstream {name}` needs a package that is not installed ({e}); "
                          f"see its section of the README for the extra to install") from None
    if configure is not None:
        p = sub.add_parser(name, help=help_, description=help_)
        getattr(mod, configure)(p, rest)
        return
    from avatarstream.cli_commands import cmd_module

    usage = getattr(mod, "USAGE", None)
    extra = {"description": usage, "formatter_class": argparse.RawDescriptionHelpFormatter} if usage else {
        "description": help_}
    p = sub.add_parser(name, help=help_, **extra)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object last")
    mod.add_arguments(p)
    p.set_defaults(func=cmd_module, cmd_module=mod)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser. With `argv`, only the command it names is built (its module
    imported); every other command is listed with its help alone. Without, every command is
    built (a command whose optional packages are missing is left out)."""
    parser = argparse.ArgumentParser(prog="avatarstream", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    word = None if argv is None else next((a for a in argv if not a.startswith("-")), None)
    rest = [] if word is None or argv is None else argv[argv.index(word) + 1:]
    for name, (_, _, help_) in COMMANDS.items():
        if argv is not None and name != word:
            sub.add_parser(name, help=help_)
            continue
        try:
            _add_command(sub, name, rest)
        except ConfigError as e:
            if argv is not None:
                raise
            log.debug("%s unavailable: %s", name, e)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(argv)
    except AvatarStreamError as e:
        print(f"avatarstream: error: {e}", file=sys.stderr)
        return e.exit_code
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    interrupt.install()  # Ctrl-C inside the muxer is raised after it, never lost
    try:
        return int(args.func(args) or 0)
    except AvatarStreamError as e:
        print(f"avatarstream: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:  # its message may say where the partial output is kept
        print(f"avatarstream: {e.args[0] if e.args else 'interrupted'}", file=sys.stderr)
        return 130
    finally:
        log.debug("done in %.2f s", time.perf_counter() - t0)


if __name__ == "__main__":
    sys.exit(main())
