"""A real RTMP server for tests: Debian's nginx with its RTMP module, on a free loopback port.

    with NginxRTMP(tmp_path) as server:        # writes its nginx.conf, starts nginx, waits
        url = server.url("key")                # rtmp://127.0.0.1:PORT/live/key
        server.wait_players(1)                 # until a player subscribed (the stat page says so)
        server.restart()                       # kill -9 and start again on the same port

`missing()` says why the tests cannot run here (no nginx binary or no RTMP module), else None.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from avatarstream.parallel.run import free_port

MODULE = Path("/usr/lib/nginx/modules/ngx_rtmp_module.so")
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"  # /usr/sbin is not on every user's PATH
APP = "live"


def missing() -> str | None:
    """Why a real nginx-rtmp cannot be started here (None: it can)."""
    if not Path(NGINX).exists():
        return "nginx is not installed (Debian: apt-get install nginx-light libnginx-mod-rtmp)"
    if not MODULE.exists():
        return f"nginx's RTMP module {MODULE} is missing (Debian: apt-get install libnginx-mod-rtmp)"
    return None




class NginxRTMP:
    """nginx serving one live RTMP application (`live`) and its stat page, in `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port, self.http_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None
        root.mkdir(parents=True, exist_ok=True)
        self.conf = root / "nginx.conf"
        self.conf.write_text(self._config())

    def _config(self) -> str:
        r = self.root
        temps = " ".join(f"{k}_temp_path {r / k};" for k in ("client_body", "proxy", "fastcgi",
                                                              "uwsgi", "scgi"))
        return (f"load_module {MODULE};\n"
                f"daemon off;\nmaster_process off;\npid {r / 'nginx.pid'};\n"
                f"error_log {r / 'error.log'} info;\n"
                "events { worker_connections 64; }\n"
                f"rtmp {{ server {{ listen 127.0.0.1:{self.port};\n"
                f"  application {APP} {{ live on; }} }} }}\n"
                f"http {{ access_log off; {temps}\n"
                f"  server {{ listen 127.0.0.1:{self.http_port}; location /stat {{ rtmp_stat all; }} }} }}\n")

    def url(self, key: str) -> str:
        return f"rtmp://127.0.0.1:{self.port}/{APP}/{key}"

    def start(self, timeout: float = 10.0) -> None:
        self.proc = subprocess.Popen([NGINX, "-p", str(self.root), "-c", str(self.conf),
                                      "-e", str(self.root / "error.log")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited: {self.proc.stderr.read().decode()[-2000:]}"
                                   f"{self.log()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"nginx did not listen on {self.port} in {timeout} s: {self.log()[-2000:]}")

    def stop(self) -> None:
        """Kill nginx (SIGKILL: the connections drop as when a server dies) and reap it."""
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def players(self) -> int:
        """Clients playing in the application now, from the RTMP module's stat page."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/stat", timeout=2) as r:
            xml = r.read().decode()
        clients = re.findall(r"<client>(.*?)</client>", xml, re.S)
        return sum(1 for c in clients if "<publishing/>" not in c)

    def wait_players(self, n: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.players() < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{n} player(s) did not subscribe in {timeout} s")
            time.sleep(0.05)

    def log(self) -> str:
        p = self.root / "error.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def __enter__(self) -> NginxRTMP:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
