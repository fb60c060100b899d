"""`avatarstream annotate`: people judge pairs of renders; their preferences (or the reward's)
become the preference lines Diffusion-DPO trains on.

    avatarstream annotate PAIRS [--db FILE] [--host 127.0.0.1] [--port 8790] [--annotator NAME] [--fixed-sides]
        A local web page: the two renders of a pair side by side, played as one (the left one
        heard, the right one muted), the pair's text and the progress. Keys: Left/1 left is
        better, Right/2 right is better, t/3 tie, s/4 skip, space play/pause, u undo. Every
        choice goes into the SQLite database (default PAIRS/annotations.sqlite) with the
        annotator's name, the time and whether the sides were shown swapped (each annotator
        sees a pair's sides in an order of their own unless --fixed-sides; the choice is stored
        in terms of the on-disk left/right).
    avatarstream annotate export PAIRS --out prefs.jsonl [--db FILE] [--annotator NAME]
        One line per decisive judgement (the latest of each annotator on each pair):
        {"pair", "condition", "chosen", "rejected", "chosen_video", "rejected_video",
         "annotator", "time", "source": "human"}; ties and skips are counted, not written.
    avatarstream annotate auto PAIRS --out prefs.jsonl [--margin 0.02]
        The same lines from the reward totals in pairs.jsonl ("auto"): the higher render of each
        pair whose scores differ by at least the margin ("annotator": "reward", "source": "auto").

PAIRS is a folder made by `avatarstream train pairs`: pairs.jsonl (one pair per line, paths
relative to the folder) and the renders it names.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from avatarstream.errors import ConfigError

USAGE = __doc__.split("\n\n", 1)[1].rsplit("\n\n", 1)[0]
FORMS = ("export", "auto")
DB_NAME = "annotations.sqlite"
# which options each form takes (argparse dests); anything else given is a one-line error
_OPTIONS = {"page": ("db", "host", "port", "annotator", "fixed_sides"),
            "export": ("db", "out", "annotator"), "auto": ("out", "margin")}
_ALL = ("db", "host", "port", "annotator", "fixed_sides", "out", "margin")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.usage = ("avatarstream annotate PAIRS [options]\n       avatarstream annotate export PAIRS --out FILE "
               "[options]\n       avatarstream annotate auto PAIRS --out FILE [--margin M]")
    p.add_argument("form", metavar="PAIRS|export|auto", help="a pairs folder (the web page), or export / auto")
    p.add_argument("pairs", nargs="?", metavar="PAIRS", help="export, auto: the pairs folder")
    p.add_argument("--db", help=f"the annotation database (SQLite; default PAIRS/{DB_NAME})")
    p.add_argument("--host", help="page: address to listen on (default 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, help="page: port (default 8790; 0: any free one)")
    p.add_argument("--annotator", help="page: the name filled in on the page; export: only this annotator")
    p.add_argument("--fixed-sides", action="store_true", default=None,
                   help="page: show every pair in its on-disk order (default: each annotator sees "
                        "the sides of each pair in an order of their own)")
    p.add_argument("--out", help="export, auto: the preference file to write (.jsonl)")
    p.add_argument("--margin", type=float, help="auto: smallest score difference that decides a pair (default 0.02)")


def _form(args: argparse.Namespace) -> tuple[str, str]:
    """(form, pairs folder) from the positional words."""
    if args.form in FORMS:
        if args.pairs is None:
            raise ConfigError(f"give the pairs folder: avatarstream annotate {args.form} PAIRS --out FILE")
        return args.form, args.pairs
    if args.pairs is not None:
        raise ConfigError(f"unexpected argument {args.pairs!r}: the page takes one pairs folder "
                          f"(or use `annotate export PAIRS` / `annotate auto PAIRS`)")
    return "page", args.form


def run(args: argparse.Namespace) -> dict[str, Any]:
    from avatarstream.annotate.pairs import load_pairs

    form, pairs = _form(args)
    wrong = [d for d in _ALL if getattr(args, d, None) is not None and d not in _OPTIONS[form]]
    if wrong:
        name = "the page" if form == "page" else f"`annotate {form}`"
        raise ConfigError(f"{name} takes no {', '.join('--' + w.replace('_', '-') for w in wrong)}")
    if form != "page" and not args.out:
        raise ConfigError(f"`annotate {form}` needs --out FILE (the preference lines to write)")
    folder = load_pairs(pairs)
    db = Path(args.db) if args.db else folder.root / DB_NAME
    if form == "export":
        from avatarstream.annotate.export import export_human

        return export_human(folder, db, args.out, annotator=args.annotator)
    if form == "auto":
        from avatarstream.annotate.export import export_auto

        return export_auto(folder, args.out, margin=0.02 if args.margin is None else args.margin)
    return _page(args, folder, db)


def _page(args: argparse.Namespace, folder: Any, db: Path) -> dict[str, Any]:
    from avatarstream.annotate.app import Annotation, make_app, serve
    from avatarstream.annotate.store import Store, check_annotator

    annotator = check_annotator(args.annotator) if args.annotator is not None else None
    port = 8790 if args.port is None else args.port
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be 0..65535, not {port}")
    with Store(db) as store:
        annotation = Annotation(folder, store, annotator, shuffle_sides=not args.fixed_sides)
        serve(make_app(annotation), args.host or "127.0.0.1", port,
              on_listening=lambda url: print(f"listening on {url} ({len(folder.pairs)} pairs, "
                                             f"database {db})", file=sys.stderr, flush=True))
        judgements = len(store.all())
    return {"pairs": len(folder.pairs), "db": str(db), "judgements": judgements}
