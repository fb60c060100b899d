"""What `verify` fetches from the network, and under which limits.

Every request of a `verify URL` goes through one `Fetcher`; FFmpeg never fetches anything
itself (it is handed local bytes only: provenance/hls.py), so these rules hold for the playlist,
its segments, their keys and init sections alike:

- **Headers stay with their origin.** The user's headers (`--header 'Authorization: Bearer
  KEY'`) go with a request only when its scheme, host and port are those of the URL given; a
  segment, key or playlist on another origin, and a redirect to another origin, get none.
- **http and https only**, redirects included (a redirect to `ftp:`, `file:` or anything else is
  refused), at most `max_redirects` of them per request.
- **Bounded.** At most `max_requests` requests and `max_bytes` bytes in all, and `deadline_s`
  seconds for the whole verify (checked between reads; one socket wait is at most 30 s and never
  starts later than the deadline). A response whose
  Content-Length is over what may still be read is refused before a byte of it is read; the
  bytes actually read are counted too (a server may send no length, or lie).

Breaking a limit is an InputError naming the limit and the flag that raises it.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.client import HTTPResponse
from typing import IO

from avatarstream.errors import InputError

SCHEMES = ("http", "https")
_REDIRECTS = (301, 302, 303, 307, 308)
_CHUNK = 1 << 16


@dataclass(frozen=True)
class Limits:
    """How much one `verify URL` may fetch (the CLI's flags; module doc)."""

    max_bytes: int = 2 << 30  # --max-download-mb: everything downloaded, segments included
    deadline_s: float = 300.0  # --timeout: the whole verify
    max_requests: int = 64  # --max-requests
    max_redirects: int = 5
    max_playlist_bytes: int = 1 << 20  # --max-playlist-kb: one playlist
    max_playlist_lines: int = 20_000  # --max-playlist-lines: one playlist
    max_depth: int = 3  # --max-playlist-depth: a master playlist naming a media playlist is 2
    max_segments: int = 32  # --max-segments: segments read from a media playlist


def origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) with the scheme's default port filled in."""
    p = urllib.parse.urlsplit(url)
    scheme = p.scheme.lower()
    try:
        port = p.port
    except ValueError:
        port = -1  # a malformed port: never equal to a valid origin
    return scheme, (p.hostname or "").lower(), port or {"http": 80, "https": 443}.get(scheme)


def checked_url(url: str, base: str | None = None) -> str:
    """`url` resolved against `base`; InputError unless it is an http(s) URL with a host (a
    remote playlist never names a local file)."""
    full = urllib.parse.urljoin(base, url) if base else url
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in full):
        raise InputError(f"refusing the URL {shown_url(full)!r}: it contains spaces or control characters")
    p = urllib.parse.urlsplit(full)
    if p.scheme.lower() not in SCHEMES or not p.hostname:
        raise InputError(f"refusing the URL {shown_url(full)!r}: only http and https URLs are fetched")
    return full


def shown_url(url: str) -> str:
    """`url` without its query and user info (either may hold a key), cut to 200 characters."""
    p = urllib.parse.urlsplit(url)
    host = p.netloc.rpartition("@")[2]
    shown = urllib.parse.urlunsplit((p.scheme, host, p.path, "", ""))
    return (shown[:200] + "...") if len(shown) > 200 else shown


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects come back as responses: the Fetcher follows them itself (module doc)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        return None


class Fetcher:
    """All the requests of one verify (module doc): `headers` go to the origin of `url` only."""

    def __init__(self, url: str, headers: dict[str, str] | None, limits: Limits) -> None:
        self.url = checked_url(url)
        self.origin = origin(self.url)
        self.headers = dict(headers or {})
        self.limits = limits
        self.requests = 0
        self.bytes = 0
        self._deadline = time.monotonic() + limits.deadline_s
        self._opener = urllib.request.build_opener(_NoRedirects())

    def _left(self) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise InputError(f"cannot verify {shown_url(self.url)}: it took longer than "
                             f"{self.limits.deadline_s:g} s (--timeout)")
        return left

    def open(self, url: str, *, byterange: tuple[int, int] | None = None) -> tuple[str, HTTPResponse]:
        """GET `url` (following redirects under the rules above): (the final URL, its response)."""
        url = checked_url(url)
        for _ in range(self.limits.max_redirects + 1):
            if self.requests >= self.limits.max_requests:
                raise InputError(f"cannot verify {shown_url(self.url)}: it needs more than "
                                 f"{self.limits.max_requests} requests (--max-requests)")
            self.requests += 1
            headers = dict(self.headers) if origin(url) == self.origin else {}
            if byterange is not None:
                headers["Range"] = f"bytes={byterange[0]}-{byterange[0] + byterange[1] - 1}"
            request = urllib.request.Request(url, headers=headers)
            try:
                return url, self._opener.open(request, timeout=min(30.0, self._left()))
            except urllib.error.HTTPError as e:
                location = e.headers.get("Location") if e.code in _REDIRECTS else None
                e.close()
                if location is None:
                    hint = (" (a key-protected URL, such as a server's render, needs --header "
                            "'Authorization: Bearer KEY')" if e.code in (401, 403) and not self.headers
                            and origin(url) == self.origin else "")
                    raise InputError(f"cannot download {shown_url(url)}: "
                                     f"HTTP {e.code} {e.reason}{hint}") from None
                url = checked_url(location, url)
            except (urllib.error.URLError, OSError, ValueError) as e:
                if isinstance(e, TimeoutError) or "timed out" in str(e):
                    self._left()  # the whole verify's limit, when that is what cut the wait
                reason = getattr(e, "reason", None) or e
                if isinstance(reason, OSError) and reason.strerror:
                    reason = reason.strerror.lower()  # "connection refused", without the errno
                raise InputError(f"cannot download {shown_url(url)}: {reason}") from None
        raise InputError(f"cannot download {shown_url(self.url)}: more than "
                         f"{self.limits.max_redirects} redirects")

    def chunks(self, response: HTTPResponse, url: str, limit: int, what: str) -> Iterator[bytes]:
        """The body of `response`, refused as a whole when Content-Length says it is over
        `limit` (or over what the verify may still read), else counted as it comes."""
        limit = min(limit, self.limits.max_bytes - self.bytes)
        length = response.headers.get("Content-Length", "")
        if length.isdigit() and int(length) > limit:
            raise self._too_big(url, what, limit)
        while True:
            self._left()  # a server that drips bytes is cut at the deadline too
            chunk = response.read1(_CHUNK)
            if not chunk:
                return
            self.bytes += len(chunk)
            limit -= len(chunk)
            if limit < 0:
                raise self._too_big(url, what, None)
            yield chunk

    def _too_big(self, url: str, what: str, limit: int | None) -> InputError:
        if what == "playlist":
            return InputError(f"cannot verify {shown_url(url)}: the playlist is larger than "
                              f"{self.limits.max_playlist_bytes // 1024} KB (--max-playlist-kb)")
        return InputError(f"cannot verify {shown_url(url)}: it is larger than "
                          f"{self.limits.max_bytes / 2**20:.0f} MB (--max-download-mb)")

    def read(self, url: str, limit: int, what: str = "file",
             byterange: tuple[int, int] | None = None) -> tuple[str, bytes]:
        """(final URL, whole body) of `url`, at most `limit` bytes."""
        final, response = self.open(url, byterange=byterange)
        with response:
            return final, b"".join(self.chunks(response, final, limit, what))

    def save(self, response: HTTPResponse, url: str, out: IO[bytes], first: bytes = b"") -> None:
        """Write `first` and the rest of `response` to `out` (under the byte limit)."""
        out.write(first)
        for chunk in self.chunks(response, url, self.limits.max_bytes, "file"):
            out.write(chunk)
