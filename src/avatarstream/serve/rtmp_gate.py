"""Where a server session may push RTMP (`serve --rtmp-allow`), checked without holding up anyone.

Who may name what
-----------------
`--rtmp-allow` is a comma-separated list of host patterns (fnmatch: `*.live-video.net`) and IP
addresses or networks (`203.0.113.7`, `10.1.0.0/16`, `::1`). A session's `rtmp_url` is pushed
when its host matches a pattern and its address is one the list allows:
- a public (globally routed) address, for any matching pattern: `*` (the default) is any host on
  a public address;
- any address at all for a host named exactly (`localhost`, `ingest.corp.example`): the operator
  trusts that name's DNS;
- an address inside a listed network, whatever the host is called.
So loopback, private, link-local, multicast and unspecified addresses are refused unless named,
by host or by network; `""` turns RTMP off. A refusal is one 400 that says the same whether the
host does not exist, does not resolve, or resolves to an address not allowed (it maps nothing).

How it is checked
-----------------
The host is resolved once, on this module's own threads (never the shared executor, so a slow
resolver holds up only RTMP checks), within `resolve_timeout_s`; the addresses allowed are tried
with asyncio connections (no thread waits on a remote host) within `connect_timeout_s`, and the
stream then connects to the address that answered, not to the name (no DNS rebinding; rtmp_url.py
says how). An rtmps:// host named exactly keeps its name instead (TLS SNI: FFmpeg sends none to an
IP). Each key has at most `per_key` checks in flight and `per_key_per_minute` a minute, and the
server `total` at once; beyond, a 429 with Retry-After. The caller admits the session (capacity)
before it asks here: a full server answers 503 without connecting anywhere.
"""

from __future__ import annotations

import asyncio
import fnmatch
import functools
import ipaddress
import time
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from avatarstream.errors import AvatarStreamError, ConfigError
from avatarstream.publish.output import os_reason
from avatarstream.publish.rtmp import RTMPSink
from avatarstream.publish.rtmp_url import RTMPTarget, parse_rtmp_url, resolve

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class RTMPRefused(Exception):
    """An rtmp_url the server does not push to: the HTTP status and the one-line reason."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after


def _address(text: str) -> Address:
    ip = ipaddress.ip_address(text.partition("%")[0])
    return ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip


def is_public(ip: Address) -> bool:
    """A globally routed unicast address (not loopback, private, link-local, shared, reserved,
    multicast or unspecified)."""
    return ip.is_global and not (ip.is_multicast or ip.is_loopback or ip.is_link_local
                                 or ip.is_unspecified or ip.is_reserved or ip.is_private
                                 or getattr(ip, "is_site_local", False))


@dataclass(frozen=True)
class RTMPPolicy:
    """`--rtmp-allow` read (module doc)."""

    hosts: tuple[str, ...]  # fnmatch patterns, lower case
    networks: tuple[Network, ...]

    @classmethod
    @functools.lru_cache(maxsize=16)
    def parse(cls, entries: tuple[str, ...]) -> RTMPPolicy:
        """The policy of `--rtmp-allow`'s entries; a ConfigError naming an entry that is neither
        a host pattern nor an IP address or network."""
        hosts, networks = [], []
        for raw in entries:
            entry = raw.strip().lower()
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                continue
            except ValueError:
                if "/" in entry or ":" in entry or not all(c.isalnum() or c in "-._*?[]!" for c in entry):
                    raise ConfigError(f"--rtmp-allow: {raw!r} is neither a host pattern "
                                      "(*.example.com) nor an IP address or network (10.0.0.0/8)") from None
            hosts.append(entry)
        return cls(tuple(hosts), tuple(networks))

    @property
    def off(self) -> bool:
        return not self.hosts and not self.networks

    def named(self, host: str) -> bool:
        """`host` is on the list by its exact name (no wildcard)."""
        return host in self.hosts and not any(c in host for c in "*?[")

    def matches(self, host: str) -> bool:
        return any(fnmatch.fnmatchcase(host, p) for p in self.hosts)

    def admits(self, host: str, address: str) -> bool:
        """A stream to `host` may connect to `address` (module doc)."""
        ip = _address(address)
        if any(ip in net for net in self.networks):
            return True
        return self.matches(host) and (self.named(host) or is_public(ip))


class RTMPGate:
    """Turns a session's `rtmp_url` into a checked RTMPSink (module doc); one per server."""

    def __init__(self, *, per_key: int = 2, per_key_per_minute: int = 20, total: int = 16,
                 resolve_timeout_s: float = 5.0, connect_timeout_s: float = 5.0,
                 threads: int = 4) -> None:
        self.per_key, self.per_key_per_minute, self.total = per_key, per_key_per_minute, total
        self.resolve_timeout_s, self.connect_timeout_s = resolve_timeout_s, connect_timeout_s
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="avatarstream-rtmp-dns")
        self._in_flight: Counter[str] = Counter()
        self._recent: dict[str, deque[float]] = {}

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def sink(self, tenant: str, url: object, allow: tuple[str, ...]) -> RTMPSink:
        """The checked sink for `url` (raises RTMPRefused)."""
        policy = RTMPPolicy.parse(tuple(allow))
        if policy.off:
            raise RTMPRefused(400, 'this server does not push RTMP (started with --rtmp-allow "")')
        try:
            target = parse_rtmp_url(url)
        except ConfigError as e:
            raise RTMPRefused(400, str(e)) from None
        if target.scheme == "srt":
            raise RTMPRefused(400, "this server pushes to rtmp:// and rtmps:// URLs only")
        refused = RTMPRefused(400, f"this server does not push to {target.host!r}: it is not on "
                              "--rtmp-allow, or does not resolve to an address allowed there "
                              "(public addresses; others only when named)")
        if not policy.networks and not policy.matches(target.host):
            raise refused  # no DNS query for a name off the list
        with self._slot(tenant):
            addresses = await self._resolve(target)
            allowed = [a for a in addresses if policy.admits(target.host, a)]
            if not allowed:
                raise refused
            address = await self._reachable(target, allowed)
        keep_name = target.scheme == "rtmps" and policy.named(target.host)
        return RTMPSink(target, address=None if keep_name else address, wait_on_close=False,
                        connect_timeout_s=self.connect_timeout_s)

    @contextmanager
    def _slot(self, tenant: str) -> Iterator[None]:
        now = time.monotonic()
        recent = self._recent.setdefault(tenant, deque())
        while recent and recent[0] < now - 60:
            recent.popleft()
        if sum(self._in_flight.values()) >= self.total:
            raise RTMPRefused(429, "the server is checking too many RTMP targets; try again later",
                              retry_after=5)
        if self._in_flight[tenant] >= self.per_key or len(recent) >= self.per_key_per_minute:
            raise RTMPRefused(429, f"too many RTMP targets checked for this key (at most "
                              f"{self.per_key} at once and {self.per_key_per_minute} a minute); "
                              "try again later", retry_after=5 if recent else 60)
        recent.append(now)
        self._in_flight[tenant] += 1
        try:
            yield
        finally:
            self._in_flight[tenant] -= 1
            if self._in_flight[tenant] <= 0:
                del self._in_flight[tenant]
            for key in [k for k, q in self._recent.items() if not q or q[-1] < now - 60]:
                if key not in self._in_flight:
                    del self._recent[key]

    async def _resolve(self, target: RTMPTarget) -> list[str]:
        """The host's addresses, resolved on this gate's threads; none when it does not resolve
        in time (the caller's refusal says the same as for an address not allowed)."""
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._executor, resolve, target),
                                          self.resolve_timeout_s)
        except (AvatarStreamError, asyncio.TimeoutError):
            return []

    async def _reachable(self, target: RTMPTarget, addresses: list[str]) -> str:
        """The first address that accepts a TCP connection (asyncio: no thread waits)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_timeout_s
        reason = "timed out"
        for address in addresses:
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(address, target.port_or_default), left)
            except asyncio.TimeoutError:
                reason = "timed out"
                continue
            except OSError as e:
                reason = os_reason(e) or "cannot connect"
                continue
            writer.close()
            return address
        raise RTMPRefused(400, f"cannot publish to {target.shown}: {reason}")
