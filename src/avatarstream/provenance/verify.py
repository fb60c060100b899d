"""`avatarstream verify FILE|URL`: is this video marked as AI-generated, and by what?

Two independent signals are read:
- **Content credentials** (C2PA, provenance/credentials.py): c2pa-rs reads and validates the
  manifest store. `valid`: the claim signature verifies and the hashes match the file (a changed
  byte fails); `trusted`: the signer chains to a trust list c2pa knows (our local self-signed
  certificate never does: it is reported as `self_signed`, and `local_certificate` says that it
  is this machine's, when it chains to the local CA in the config folder). A valid manifest whose
  `c2pa.created` action has an AI digital source type (IPTC `trainedAlgorithmicMedia` and its
  kin) marks the file; the model comes from our `org.avatarstream.generation` assertion.
- **The invisible watermark** in the frames (provenance/watermark.py, `detect_video`), which
  survives re-encoding and travels where no manifest does (live streams, HLS, screen captures).

A URL is either an HLS playlist (`.m3u8`, or served as an mpegurl: PyAV reads it for the
watermark; HLS segments carry no manifest) or a file, downloaded into a temporary file of at most
`max_download_bytes` and then read as a file. A local `.m3u8` is read as a stream too. `headers`
(`verify --header 'Authorization: Bearer KEY'`, for a server's render or session stream) go with
the URL's requests: the download (not to another host it redirects to) or FFmpeg's requests of
the playlist and its segments.

The report is a dict (the CLI prints `describe(report)` and, with --json, the dict as JSON);
`EXIT_MARKED` (0) when either signal marks the file, `EXIT_NOT_MARKED` (1) when neither does; a
missing or unreadable input is an InputError (the CLI's exit 2).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import c2pa

from avatarstream.errors import InputError
from avatarstream.provenance.credentials import GENERATION_LABEL, LOCAL_ORG, local_paths

log = logging.getLogger(__name__)

EXIT_MARKED = 0
EXIT_NOT_MARKED = 1
AI_SOURCE_TYPES = frozenset(
    f"http://cv.iptc.org/newscodes/digitalsourcetype/{t}"
    for t in ("trainedAlgorithmicMedia", "compositeWithTrainedAlgorithmicMedia",
              "algorithmicMedia", "compositeSynthetic"))
UNTRUSTED = "signingCredential.untrusted"
MAX_DOWNLOAD_BYTES = 2 << 30
_CHUNK = 1 << 20


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
        self_signed=local or sig.get("issuer") == LOCAL_ORG, local_certificate=local,
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


def read_watermark(source: str, headers: dict[str, str] | None = None) -> dict:
    """The watermark detector's result for a file path or a stream URL (sent with `headers`), as
    a dict."""
    from avatarstream.provenance.watermark import detect_video

    return detect_video(source, headers=headers).to_json()


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
    return urllib.parse.urlparse(target).scheme in ("http", "https")


def _is_playlist(url: str, content_type: str) -> bool:
    return (urllib.parse.urlparse(url).path.lower().endswith(".m3u8")
            or "mpegurl" in content_type.lower())


@contextlib.contextmanager
def _opened(target: str, max_download_bytes: int,
            headers: dict[str, str]) -> Iterator[tuple[Path | None, str]]:
    """(local file or None for a stream, what the watermark detector reads) for `target`."""
    if not _is_url(target):
        path = Path(target)
        if not path.exists():
            raise InputError(f"cannot verify {target}: no such file")
        if not path.is_file() or not os.access(path, os.R_OK):
            raise InputError(f"cannot verify {target}: not a readable file")
        yield path, str(path)
        return
    try:
        request = urllib.request.Request(target, headers=headers)
        opener = urllib.request.build_opener(_HeadersStayOnHost(headers))
        response = opener.open(request, timeout=30)  # http(s) only, checked
    except urllib.error.HTTPError as e:
        hint = (" (a key-protected URL, such as a server's render, needs --header "
                "'Authorization: Bearer KEY')" if e.code in (401, 403) and not headers else "")
        raise InputError(f"cannot download {target}: HTTP {e.code} {e.reason}{hint}") from e
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise InputError(f"cannot download {target}: {getattr(e, 'reason', None) or e}") from e
    with response:
        if _is_playlist(target, response.headers.get("Content-Type", "")):
            yield None, target
            return
        suffix = Path(urllib.parse.urlparse(target).path).suffix or ".mp4"
        with tempfile.TemporaryDirectory(prefix="avatarstream-verify-") as tmp:
            path = Path(tmp) / f"download{suffix}"
            _download(response, path, target, max_download_bytes)
            yield path, str(path)


class _HeadersStayOnHost(urllib.request.HTTPRedirectHandler):
    """A redirect to another host does not take the user's headers (a bearer key) with it."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.names = list(headers)

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlparse(newurl).netloc != urllib.parse.urlparse(req.full_url).netloc:
            for name in self.names:
                new.remove_header(name.capitalize())
        return new


def _download(response: object, path: Path, url: str, limit: int) -> None:
    size = 0
    with open(path, "wb") as f:
        while chunk := response.read(_CHUNK):  # type: ignore[attr-defined]
            size += len(chunk)
            if size > limit:
                raise InputError(f"cannot verify {url}: it is larger than {limit / 2**20:.0f} MB "
                                 "(--max-download-mb)")
            f.write(chunk)


def verify(target: str, *, max_download_bytes: int = MAX_DOWNLOAD_BYTES,
           headers: dict[str, str] | None = None) -> dict:
    """Both signals for a file or URL (module doc); `headers` go with every request of a URL
    (a server's render: `{"Authorization": "Bearer KEY"}`), its HLS segments included."""
    headers = headers or {}
    with _opened(target, max_download_bytes, headers) as (path, source):
        if path is None or path.suffix.lower() == ".m3u8":
            credentials = {"present": False, "valid": False, "trusted": False, "ai_generated": False,
                           "error": "an HLS stream carries no content credentials (C2PA covers files)"}
        else:
            credentials = read_credentials(path)
        watermark = read_watermark(source, headers if path is None else None)
    by = [name for name, marked in (("content_credentials", credentials["ai_generated"]),
                                    ("watermark", bool(watermark.get("detected")))) if marked]
    return {"target": target, "ai_generated": bool(by), "marked_by": by,
            "content_credentials": credentials, "watermark": watermark}


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
        elif c["self_signed"]:
            trust = "SELF-SIGNED, untrusted (an avatarstream local certificate)"
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
