"""What an RTMP(S)/SRT URL may name, how it is shown, and the address a stream connects to.

Parsing is strict, because Python and FFmpeg must read the URL alike: a URL with a character
outside RFC 3986 (a control character such as NUL, a space, anything non-ASCII) is refused, so a
string cannot name one host to Python and another to FFmpeg (which reads a C string up to the
first NUL). The scheme is read case-insensitively; a port must be 1-65535; a fragment, a second `@`
or a malformed IPv6 host is refused. Every refusal is one ConfigError that does not repeat the URL.

FFmpeg never gets the caller's string: `RTMPTarget.ffmpeg_url` rebuilds it from the parsed parts,
and with an `address` (an IP the caller resolved and checked) it connects to that address, so a
host name that resolves to another address later (DNS rebinding) cannot move the stream. The RTMP
`tcUrl` still carries the host name (`rtmp_tcurl`), for servers that route by it. FFmpeg sends no
TLS SNI to a numeric host, so an rtmps:// stream keeps its host name unless told otherwise.

Shown (`RTMPTarget.shown`, `redacted`): scheme, host, port and the application (the first path
part); credentials (`user:password@`), the stream key (every path part after the application) and
any query are `***`. Errors and log lines built here use that form, and `scrub` takes the secret
parts out of any text (FFmpeg's error messages repeat the URL they opened).
"""

from __future__ import annotations

import ipaddress
import re
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from avatarstream.errors import ConfigError, OutputError
from avatarstream.publish.output import os_reason

FORMATS = {"rtmp": "flv", "rtmps": "flv", "srt": "mpegts"}  # URL scheme -> muxer
PORTS = {"rtmp": 1935, "rtmps": 443}
EXAMPLE = "rtmp://live.example.com/app/STREAM-KEY"
# RFC 3986's characters (unreserved, reserved, '%'): nothing else may appear anywhere in the URL
_URL_CHARS = re.compile(r"[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]*")
_HOST = re.compile(r"[a-z0-9]([a-z0-9\-_.]*[a-z0-9])?")


@dataclass(frozen=True)
class RTMPTarget:
    """A parsed publishing URL (`parse_rtmp_url`)."""

    scheme: str  # lower case: rtmp, rtmps or srt
    host: str  # lower case; an IPv6 address without its brackets
    port: int | None  # None: the scheme's default
    userinfo: str | None  # "user:password", or None
    path: str  # "/app/KEY" ("" for none)
    query: str  # after the "?" ("" for none)

    @property
    def format(self) -> str:
        return FORMATS[self.scheme]

    @property
    def port_or_default(self) -> int:
        return self.port or PORTS.get(self.scheme, 0)

    @property
    def app(self) -> str:
        """The RTMP application as FFmpeg reads it from the path (rtmpproto.c): the first path
        part, or the first two when more than two follow ("app/instance/KEY")."""
        parts = self.path.lstrip("/").split("/")
        if len(parts) < 2:
            return ""
        if len(parts) > 2 and ":" not in parts[1]:
            return "/".join(parts[:2])
        return parts[0]

    @property
    def shown(self) -> str:
        """The URL without its secrets: `rtmp://[***@]host[:port]/app/***`."""
        app, key = _app_and_key(self.path)
        secret = "***@" if self.userinfo is not None else ""
        tail = f"/{app}" if app else ""
        if key or self.query:
            tail += "/***"
        return f"{self.scheme}://{secret}{self._netloc(self.host)}{tail}"

    def _netloc(self, host: str) -> str:
        h = f"[{host}]" if ":" in host else host
        return h if self.port is None else f"{h}:{self.port}"

    def ffmpeg_url(self, address: str | None = None) -> str:
        """The URL FFmpeg opens, rebuilt from the parts; `address`: connect to that IP."""
        auth = f"{self.userinfo}@" if self.userinfo is not None else ""
        query = f"?{self.query}" if self.query else ""
        netloc = self._netloc(address or self.host)
        if address is not None and self.port is None and self.scheme in PORTS:
            netloc = self._netloc(address) + f":{PORTS[self.scheme]}"
        return f"{self.scheme}://{auth}{netloc}{self.path}{query}"

    def ffmpeg_options(self, address: str | None) -> dict[str, str]:
        """Protocol options for `ffmpeg_url(address)`: the tcUrl names the host, not the IP."""
        if address is None or self.scheme not in PORTS:
            return {}
        h = f"[{self.host}]" if ":" in self.host else self.host
        return {"rtmp_tcurl": f"{self.scheme}://{h}:{self.port_or_default}/{self.app}"}

    def scrub(self, text: str, address: str | None = None) -> str:
        """`text` with this URL's secrets (credentials, stream key, query) replaced by `***`."""
        for url in {self.ffmpeg_url(address), self.ffmpeg_url()}:
            text = text.replace(url, self.shown)
        key, user = _app_and_key(self.path)[1], self.userinfo or ""
        secrets = [user, *user.split(":"), key, *key.split("/"), self.query]
        for s in sorted((s for s in secrets if s and len(s) >= 3), key=len, reverse=True):
            text = text.replace(s, "***")
        return text


def _app_and_key(path: str) -> tuple[str, str]:
    """(application, stream key) of a path: "/app/KEY/" -> ("app", "KEY/"); a path of one part
    is the key alone (FFmpeg reads an empty application then)."""
    app, sep, key = path.lstrip("/").partition("/")
    return (app, key) if sep else ("", app)


def parse_rtmp_url(url: object) -> RTMPTarget:
    """The parts of `url`; a ConfigError (one line, the URL not repeated) when it is not a clean
    rtmp://, rtmps:// or srt:// URL with a host (module doc)."""
    if not isinstance(url, str) or not url:
        raise ConfigError(f"give the RTMP URL as a string such as {EXAMPLE}")
    if len(url) > 4096:
        raise ConfigError("the RTMP URL is longer than 4096 characters")
    if not _URL_CHARS.fullmatch(url):
        raise ConfigError("the RTMP URL has a character a URL may not hold (a space, a control "
                          "character or a non-ASCII one); percent-encode it, e.g. %20")
    scheme = url.partition(":")[0].lower()
    if scheme not in FORMATS or not url[len(scheme):].startswith("://"):
        raise ConfigError(f"cannot publish to this URL: give an rtmp://, rtmps:// or srt:// URL "
                          f"with a host, e.g. {EXAMPLE}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:  # "Port out of range 0-65535", "Invalid IPv6 URL", a port not a number
        raise ConfigError(f"the RTMP URL's host or port is malformed ({_why(e)}); give e.g. "
                          f"{EXAMPLE} or rtmp://[2001:db8::1]:1935/app/KEY") from None
    host = parts.hostname or ""
    if parts.fragment or "#" in url:
        raise ConfigError("the RTMP URL has a #fragment; percent-encode # in a stream key as %23")
    if parts.netloc.count("@") > 1 or parts.netloc.endswith(":"):
        raise ConfigError("the RTMP URL's host part is malformed (a second @, or an empty port)")
    if port == 0:
        raise ConfigError("the RTMP URL's port must be 1-65535")
    if not host:
        raise ConfigError(f"the RTMP URL names no host; give e.g. {EXAMPLE}")
    if not _valid_host(host):
        raise ConfigError("the RTMP URL's host is not a host name or an IP address")
    userinfo = parts.netloc.rpartition("@")[0] if "@" in parts.netloc else None
    return RTMPTarget(scheme, host, port, userinfo, parts.path, parts.query)


def _why(e: ValueError) -> str:
    text = str(e)
    if "IPv6" in text:
        return "an IPv6 host is written in brackets: [2001:db8::1]"
    return "a port is a number 1-65535"


def _valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return bool(_HOST.fullmatch(host)) and ".." not in host and len(host) <= 253


def redacted(url: str) -> str:
    """`url` without its secrets (`RTMPTarget.shown`), for logs and errors; a URL that does not
    parse is shown as its scheme only."""
    try:
        return parse_rtmp_url(url).shown
    except ConfigError:
        scheme = url.partition("://")[0] if isinstance(url, str) and "://" in url else ""
        return f"{scheme[:16]}://***" if scheme.isalnum() else "(an unusable URL)"


def resolve(target: RTMPTarget) -> list[str]:
    """The target's IP addresses (once, in the resolver's order; an IP literal as it is); an
    OutputError when the host does not resolve."""
    try:
        return [str(ipaddress.ip_address(target.host))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(target.host, target.port_or_default, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise OutputError(f"cannot publish to {target.shown}: the host does not resolve "
                          f"({os_reason(e) or e})") from None
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def first_reachable(target: RTMPTarget, addresses: list[str], timeout_s: float) -> str:
    """The first of `addresses` that accepts a TCP connection on the target's port, all tries
    within `timeout_s`; an OutputError with the last reason when none does."""
    deadline = time.monotonic() + timeout_s
    reason = "no address"
    for address in addresses:
        left = deadline - time.monotonic()
        if left <= 0:
            reason = "timed out"
            break
        try:
            with socket.create_connection((address, target.port_or_default), timeout=left):
                return address
        except OSError as e:
            reason = os_reason(e) or str(e)
    raise OutputError(f"cannot publish to {target.shown}: {reason}")
