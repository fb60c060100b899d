"""What one request may cost the server: each bound a named setting with a default, checked
before the work it bounds (a body is refused before it is read, an image before it is decoded,
JSON before it is parsed, a packet before it is queued).

`Limits` holds them; `LIMIT_OPTIONS` names each one's `serve` option, unit and meaning, so the
command line (`add_limit_arguments`), `/openapi.json` (`describe_limits`) and the README say the
same thing.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, fields

from avatarstream.errors import ConfigError, InputError

MiB = 1024 * 1024
MIN_BODY_RATE = 16 * 1024  # bytes/s a request body must average once body_idle_seconds have passed


@dataclass(frozen=True)
class Limits:
    max_bytes: int = 50 * MiB  # a request body (reference upload, render speech)
    max_pixels: int = 16_000_000  # pixels of one decoded reference frame (from its header)
    max_seconds: float = 60.0  # a reference video's length
    max_parallel_uploads: int = 2  # uploads read and decoded at once; the others wait, unread
    max_json_bytes: int = 128 * 1024  # a JSON body or WebSocket control message
    max_json_depth: int = 32  # nesting of JSON arrays and objects
    max_text_chars: int = 2000  # text to speak (one say, one text render)
    max_packet_bytes: int = 65536  # one WebSocket audio packet (2 s of PCM16 mono 16 kHz)
    max_render_seconds: float = 600.0  # speech of one render
    body_idle_seconds: float = 20.0  # a request body with no byte for this long: 408

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ConfigError(f"the limit {f.name} must be positive, got {getattr(self, f.name)}")


@dataclass(frozen=True)
class LimitOption:
    name: str  # the Limits field
    flag: str  # the `serve` option
    meaning: str
    scale: float = 1  # option value * scale = the field's value


LIMIT_OPTIONS = (
    LimitOption("max_bytes", "--max-upload-mb",
                "MiB of one request body (reference upload or render speech); larger: 413 "
                "before it is read", scale=MiB),
    LimitOption("max_pixels", "--max-megapixels",
                "megapixels (width x height) of a reference image or video frame, read from its "
                "header; larger: 400 before it is decoded (a JPEG is decoded at 1/2, 1/4 or 1/8 "
                "of its size instead); each upload being decoded costs about 20 bytes a pixel",
                scale=1e6),
    LimitOption("max_seconds", "--max-reference-seconds", "seconds of a reference video; longer: 400"),
    LimitOption("max_parallel_uploads", "--max-parallel-uploads",
                "uploads (references, render speech) read and decoded at once; the others wait "
                "with their bodies unread"),
    LimitOption("max_json_bytes", "--max-json-kb",
                "KiB of a JSON body or WebSocket control message; larger: 413 (WebSocket: an "
                "error event)", scale=1024),
    LimitOption("max_json_depth", "--max-json-depth",
                "nesting depth of JSON arrays and objects; deeper: 400 before it is parsed"),
    LimitOption("max_text_chars", "--max-text-chars",
                "characters of text to speak (say, text render); longer: 400 before speech "
                "synthesis"),
    LimitOption("max_packet_bytes", "--max-packet-bytes",
                "bytes of one WebSocket audio packet (65536 = 2 s of PCM16 mono 16 kHz); larger: "
                "the socket closes with 1009 and a reason"),
    LimitOption("max_render_seconds", "--max-render-seconds",
                "seconds of speech in one render; longer: 400, decoding stops at the limit"),
    LimitOption("body_idle_seconds", "--body-idle-seconds",
                "seconds a request body may go without a byte arriving, and the most its average "
                f"rate may lag {MIN_BODY_RATE // 1024} KiB/s; slower: 408 and its upload slot is "
                "freed (a stalled client cannot hold one)"),
)


def _value(limits: Limits, o: LimitOption) -> float:
    v = getattr(limits, o.name) / o.scale
    return int(v) if float(v).is_integer() else v


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    """One `serve` option per limit, its default and meaning in --help."""
    g = p.add_argument_group("limits (what one request may cost; checked before the work)")
    default = Limits()
    for o in LIMIT_OPTIONS:
        kind = int if isinstance(getattr(default, o.name), int) and o.scale == 1 else float
        g.add_argument(o.flag, type=kind, default=_value(default, o), dest=o.name,
                       metavar=o.flag.rsplit("-", 1)[-1].upper(),  # the unit: MB, PIXELS...
                       help=f"{o.meaning} (default: %(default)s)")


def limits_from_args(args: argparse.Namespace) -> Limits:
    """The limits the `serve` options give; ConfigError naming the option of one that is not
    positive."""
    default = Limits()
    values = {}
    for o in LIMIT_OPTIONS:
        v = getattr(args, o.name) * o.scale
        if not v > 0:
            raise ConfigError(f"{o.flag} must be positive, got {getattr(args, o.name)}")
        values[o.name] = int(v) if isinstance(getattr(default, o.name), int) else float(v)
    return Limits(**values)


def describe_limits(limits: Limits) -> dict[str, dict]:
    """{field: {value, option, meaning}} as `/openapi.json` states them: the value in the
    field's unit (bytes, pixels, seconds...), the option with its value in the option's unit."""
    return {o.name: {"value": getattr(limits, o.name), "option": f"{o.flag} {_value(limits, o)}",
                     "meaning": o.meaning} for o in LIMIT_OPTIONS}


# A JSON string (escapes included) or one bracket: what nesting depth is counted from.
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def json_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON text, counted without parsing it
    (brackets inside strings do not count); linear in the text's length."""
    if text.count("[") + text.count("{") <= 1:
        return int("[" in text or "{" in text)
    depth = peak = 0
    for m in _JSON_TOKENS.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            peak = max(peak, depth)
        elif c in "]}":
            depth -= 1
    return peak


def parse_json(data: bytes | str, limits: Limits) -> object:
    """JSON text -> value, refused (InputError) when larger or deeper than the limits, before
    it is parsed; never a RecursionError."""
    size = len(data)
    if size > limits.max_json_bytes:
        raise InputError(f"the JSON is {size} bytes; the limit is {limits.max_json_bytes} bytes")
    try:
        text = data.decode() if isinstance(data, bytes) else data
    except UnicodeDecodeError as e:
        raise InputError("the JSON is not UTF-8 text") from e
    depth = json_depth(text)
    if depth > limits.max_json_depth:
        raise InputError(f"the JSON is nested {depth} levels deep; the limit is "
                         f"{limits.max_json_depth}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"the body is not valid JSON ({e.msg} at character {e.pos})") from e
    except (ValueError, RecursionError) as e:  # e.g. an integer of more than 4300 digits
        raise InputError(f"the body is not JSON this server reads ({e})") from e
