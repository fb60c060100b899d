"""`avatarstream verify FILE|URL`: is this video marked as AI-generated, and by what?

Two independent signals are read:
- **Content credentials** (C2PA, provenance/credentials.py): c2pa-rs reads and validates the
  manifest store. `valid`: the claim signature verifies and the hashes match the file (a changed
  byte fails); `trusted`: the signer chains to a trust list c2pa knows (our local self-signed
  certificate never does). `local_certificate` (and `self_signed`) say that the signer is this
  machine's local certificate: only when it chains to the local CA in the config folder (the file
  is validated again with that CA as the only anchor; the CA's key was never kept), never by its
  name, which anyone can give a certificate. A valid manifest whose
  `c2pa.created` action has an AI digital source type (IPTC `trainedAlgorithmicMedia` and its
  kin) marks the file; the model comes from our `org.avatarstream.generation` assertion.
- **The invisible watermark** in the frames (provenance/watermark.py, `detect_video`), which
  survives re-encoding and travels where no manifest does (live streams, HLS, screen captures).

A URL is fetched by `verify` itself (provenance/fetch.py: the user's `headers`, such as
`--header 'Authorization: Bearer KEY'` for a server's render or session stream, go only to the
URL's origin; http(s) only, redirects included; bounded in time, requests and bytes). An HLS
playlist (`.m3u8`/`.m3u`, served as an mpegurl, or any body that begins `#EXTM3U`) is read by
provenance/hls.py into one local file (HLS segments carry no manifest: the watermark only);
anything else is downloaded into a temporary file of at most `Limits.max_bytes` and read as a
file. FFmpeg reads what was fetched as local media only (`REMOTE_MEDIA`: no playlist format, no
protocol but `file`), so nothing fetched can make it open another file or URL. A local path is
the user's own: read as it is (a local `.m3u8` as a stream too).

The report is a dict (the CLI prints `describe(report)` and, with --json, the dict as JSON);
`EXIT_MARKED` (0) when either signal marks the file, `EXIT_NOT_MARKED` (1) when neither does; a
missing or unreadable input is an InputError (the CLI's exit 2).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import tempfile
import urllib.parse
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import c2pa

from avatarstream.errors import InputError
from avatarstream.provenance.credentials import GENERATION_LABEL, LOCAL_ORG, local_paths
from avatarstream.provenance.fetch import Fetcher, Limits, shown_url
from avatarstream.provenance.hls import is_playlist_start, read_stream

log = logging.getLogger(__name__)

EXIT_MARKED = 0
EXIT_NOT_MARKED = 1
AI_SOURCE_TYPES = frozenset(
    f"http://cv.iptc.org/newscodes/digitalsourcetype/{t}"
    for t in ("trainedAlgorithmicMedia", "compositeWithTrainedAlgorithmicMedia",
              "algorithmicMedia", "compositeSynthetic"))
UNTRUSTED = "signingCredential.untrusted"
MAX_DOWNLOAD_BYTES = Limits.max_bytes
# what FFmpeg may open of fetched bytes: local files of media formats, never a playlist format
REMOTE_MEDIA = {"protocol_whitelist": "file",
                "format_whitelist": "mov,mp4,matroska,webm,mpegts,avi,flv,mpeg,ogg,asf,h264,hevc"}


def read_credentials(path: Path) -> dict:
    """The C2PA manifest of the file at `path`, validated (see the module doc)."""
    report: dict = {"present": False, "valid": False, "trusted": False, "ai_generated": False}
    try:
        reader = c2pa.Reader.try_create(str(path))
    except c2pa.C2paError as e:  # not a format C2PA covers, or a damaged manifest store
        report["error"] = str(e)
        return report
    if reader is None:
        return report
    with reader:
        state = reader.get_validation_state()
        results = (reader.get_validation_results() or {}).get("activeManifest") or {}
        manifest = reader.get_active_manifest() or {}
    failures = [f.get("code") for f in results.get("failure", [])]
    sig = manifest.get("signature_info") or {}
    actions = [a for x in manifest.get("assertions", []) if x.get("label", "").startswith("c2pa.actions")
               for a in x.get("data", {}).get("actions", [])]
    sources = [a["digitalSourceType"] for a in actions
               if a.get("action") == "c2pa.created" and a.get("digitalSourceType")]
    ours = next((x.get("data", {}) for x in manifest.get("assertions", [])
                 if x.get("label") == GENERATION_LABEL), {})
    generator = manifest.get("claim_generator_info") or [{}]
    valid = state in ("Valid", "Trusted")
    local = valid and state != "Trusted" and _chains_to_local_ca(path)
    report.update(
        present=True, valid=valid, trusted=state == "Trusted", state=state,
        failures=[f for f in failures if f != UNTRUSTED],
        signer={"name": sig.get("common_name"), "issuer": sig.get("issuer"), "alg": sig.get("alg")},
        # only a chain to this machine's CA makes it ours: any certificate can carry our name
        self_signed=local, local_certificate=local,
        digital_source_type=sources[0] if sources else None,
        claims_ai_generated=any(s in AI_SOURCE_TYPES for s in sources),
        generator=" ".join(str(generator[0].get(k)) for k in ("name", "version") if generator[0].get(k)),
        model=ours.get("model"), synthesised_likeness=ours.get("synthesised_likeness"))
    report["ai_generated"] = valid and report["claims_ai_generated"]
    return report


def _chains_to_local_ca(path: Path) -> bool:
    """Whether the signer chains to this machine's local CA (read again with it as the anchor)."""
    ca = local_paths()[0]
    if not ca.is_file():
        return False
    try:
        settings = c2pa.Settings.from_dict({"trust": {"user_anchors": ca.read_text()}})
        with (open(path, "rb") as f, c2pa.Context(settings) as context,
              c2pa.Reader("video/mp4", f, None, context) as reader):
            return reader.get_validation_state() == "Trusted"
    except (c2pa.C2paError, OSError) as e:
        log.debug("checking %s against the local CA: %s", path, e)
        return False


def read_watermark(source: str, options: dict[str, str] | None = None) -> dict:
    """The watermark detector's result for a file (FFmpeg opened with `options`), as a dict."""
    from avatarstream.provenance.watermark import detect_video

    return detect_video(source, options=options).to_json()


def parse_headers(lines: list[str]) -> dict[str, str]:
    """`["Name: value", ...]` (curl's -H form) -> {name: value}; InputError for a line that is not
    one header."""
    headers = {}
    for line in lines:
        name, colon, value = line.partition(":")
        if not colon or not name.strip() or any(c in line for c in "\r\n") or " " in name.strip():
            shown = line.replace(":", " ").split()[0] if line.strip() else ""  # never the value: a key
            raise InputError(f"--header {shown!r}...: give one header as 'Name: value', "
                             "e.g. 'Authorization: Bearer KEY'")
        headers[name.strip()] = value.strip()
    return headers


def _is_url(target: str) -> bool:
    return urllib.parse.urlparse(target).scheme.lower() in ("http", "https")


def _is_playlist(url: str, content_type: str) -> bool:
    return (urllib.parse.urlparse(url).path.lower().endswith((".m3u8", ".m3u"))
            or "mpegurl" in content_type.lower())


@contextlib.contextmanager
def _opened(target: str, limits: Limits,
            headers: dict[str, str]) -> Iterator[tuple[Path | None, str, dict | None]]:
    """(the file for the content credentials, or None for a stream; what the watermark detector
    reads; a fetched stream's summary) for `target`."""
    if not _is_url(target):
        path = Path(target)
        if not path.exists():
            raise InputError(f"cannot verify {target}: no such file")
        if not path.is_file() or not os.access(path, os.R_OK):
            raise InputError(f"cannot verify {target}: not a readable file")
        yield (None if path.suffix.lower() == ".m3u8" else path), str(path), None
        return
    fetcher = Fetcher(target, headers, limits)
    with tempfile.TemporaryDirectory(prefix="avatarstream-verify-") as tmp:
        url, response = fetcher.open(fetcher.url)
        with response:
            playlist = _is_playlist(url, response.headers.get("Content-Type", ""))
            body = fetcher.chunks(response, url, limits.max_playlist_bytes if playlist else limits.max_bytes,
                                  "playlist" if playlist else "file")
            first = b""
            for chunk in body:  # enough to tell a playlist (FFmpeg would read one as HLS)
                first += chunk
                if len(first) >= 64:
                    break
            if playlist or is_playlist_start(first):
                text = first + b"".join(_upto(body, limits.max_playlist_bytes - len(first), fetcher, url))
                stream = read_stream(fetcher, text, url, Path(tmp))
                yield None, str(stream.path), {**stream.summary(), "requests": fetcher.requests}
                return
            suffix = Path(urllib.parse.urlparse(url).path).suffix or ".mp4"
            path = Path(tmp) / f"download{suffix if suffix.isascii() and len(suffix) <= 6 else '.mp4'}"
            with open(path, "wb") as f:
                f.write(first)
                for chunk in body:
                    f.write(chunk)
        yield path, str(path), None


def _upto(chunks: Iterator[bytes], left: int, fetcher: Fetcher, url: str) -> Iterator[bytes]:
    """The rest of a playlist's body, at most `left` more bytes."""
    for chunk in chunks:
        left -= len(chunk)
        if left < 0:
            raise fetcher._too_big(url, "playlist", None)
        yield chunk


def verify(target: str, *, max_download_bytes: int | None = None,
           headers: dict[str, str] | None = None, limits: Limits | None = None) -> dict:
    """Both signals for a file or URL (module doc); `headers` go with the requests of a URL to
    its origin only (a server's render: `{"Authorization": "Bearer KEY"}`); `limits` bound what
    a URL may fetch (`max_download_bytes` overrides their byte limit)."""
    limits = limits or Limits()
    if max_download_bytes is not None:
        limits = replace(limits, max_bytes=max_download_bytes)
    remote = _is_url(target)
    with _opened(target, limits, headers or {}) as (path, source, stream):
        if path is None:
            credentials = {"present": False, "valid": False, "trusted": False, "ai_generated": False,
                           "error": "an HLS stream carries no content credentials (C2PA covers files)"}
        else:
            credentials = read_credentials(path)
        watermark = read_watermark(source, REMOTE_MEDIA if remote else None)
    by = [name for name, marked in (("content_credentials", credentials["ai_generated"]),
                                    ("watermark", bool(watermark.get("detected")))) if marked]
    report = {"target": shown_url(target) if remote else target, "ai_generated": bool(by),
              "marked_by": by, "content_credentials": credentials, "watermark": watermark}
    if stream is not None:
        report["stream"] = stream
    return report


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    """`verify`'s limits on what a URL may fetch (provenance/fetch.py)."""
    d = Limits()
    p.add_argument("--timeout", type=float, default=d.deadline_s, metavar="S",
                   help=f"give up on a URL after S seconds in all (default {d.deadline_s:g})")
    p.add_argument("--max-requests", type=int, default=d.max_requests, metavar="N",
                   help=f"at most N HTTP requests for a URL, redirects included (default {d.max_requests})")
    p.add_argument("--max-segments", type=int, default=d.max_segments, metavar="N",
                   help=f"read at most N segments of an HLS stream (default {d.max_segments})")
    p.add_argument("--max-playlist-kb", type=int, default=d.max_playlist_bytes // 1024, metavar="KB",
                   help=f"refuse a larger HLS playlist (default {d.max_playlist_bytes // 1024})")
    p.add_argument("--max-playlist-lines", type=int, default=d.max_playlist_lines, metavar="N",
                   help=f"refuse an HLS playlist of more lines (default {d.max_playlist_lines})")
    p.add_argument("--max-playlist-depth", type=int, default=d.max_depth, metavar="N",
                   help=f"follow master playlists at most N deep (default {d.max_depth})")


def limits_from(args: argparse.Namespace) -> Limits:
    """The Limits of `verify`'s command line; InputError for a value that is not positive."""
    values = {"timeout": args.timeout, "max-requests": args.max_requests,
              "max-segments": args.max_segments, "max-playlist-kb": args.max_playlist_kb,
              "max-playlist-lines": args.max_playlist_lines,
              "max-playlist-depth": args.max_playlist_depth, "max-download-mb": args.max_download_mb}
    for name, value in values.items():
        if not value > 0:
            raise InputError(f"--{name} must be positive (got {value})")
    return Limits(max_bytes=round(args.max_download_mb * 2**20), deadline_s=args.timeout,
                  max_requests=args.max_requests, max_segments=args.max_segments,
                  max_playlist_bytes=args.max_playlist_kb * 1024,
                  max_playlist_lines=args.max_playlist_lines, max_depth=args.max_playlist_depth)


def exit_code(report: dict) -> int:
    return EXIT_MARKED if report["ai_generated"] else EXIT_NOT_MARKED


def describe(report: dict) -> list[str]:
    """The report in words, one line each."""
    c, w = report["content_credentials"], report["watermark"]
    verdict = (f"AI-GENERATED (marked by {' and '.join(report['marked_by'])})" if report["ai_generated"]
               else "no AI-generation mark found")
    lines = [f"{report['target']}: {verdict}"]
    if not c["present"]:
        lines.append(f"  content credentials: none ({c['error']})" if c.get("error")
                     else "  content credentials: none")
    else:
        signer = c["signer"]["name"] or "unknown signer"
        if c["trusted"]:
            trust = "trusted signer"
        elif c["local_certificate"]:
            trust = "SELF-SIGNED, untrusted (this machine's local avatarstream certificate)"
        elif c["signer"].get("issuer") == LOCAL_ORG:
            trust = (f"untrusted signer: its certificate is named {LOCAL_ORG!r} but is NOT this "
                     "machine's local certificate (anyone can give a certificate that name)")
        else:
            trust = "untrusted signer (not on a C2PA trust list c2pa knows)"
        state = "valid" if c["valid"] else f"INVALID ({', '.join(c['failures']) or c['state']})"
        lines.append(f"  content credentials: {state}; signed by {signer}, {trust}")
        lines.append(f"  source type: {c['digital_source_type'] or 'not stated'}"
                     + (f"; model {c['model']}" if c.get("model") else "")
                     + (f"; made by {c['generator']}" if c.get("generator") else ""))
    if w.get("detected"):
        lines.append(f"  watermark: detected (bit accuracy {w.get('bit_accuracy', 0):.2f}, "
                     f"p = {w.get('p_value', 1):.2g}, {w.get('frames')} frames)")
    else:
        lines.append(f"  watermark: not detected ({w.get('frames')} frames read)")
    return lines
