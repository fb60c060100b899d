"""Ray for one command (`curate`, `batch`): a local instance started quietly for the call and
stopped after it, the instance this process already runs, or an existing cluster at an address
(`ray start --head` on one machine, `ray start --address=HEAD:6379` on the others). Shared by the
training-data curation and the batch renderer, which must not import each other's packages."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from avatarstream.errors import ConfigError

log = logging.getLogger(__name__)


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """ConfigError unless `address` ("host:port" or "ray://host:port"; "auto" is not checked)
    accepts a TCP connection: Ray itself retries an unreachable address for minutes."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot reach a Ray cluster at {address!r} ({e}); give host:port of its head node") from e


@contextmanager
def ray_session(workers: int, address: str | None, *, cpus: int | None = None) -> Iterator[None]:
    """Ray for one call: the running instance, the cluster at `address`, or a local one with
    `cpus` CPUs (default `workers`) that is shut down afterwards."""
    import ray  # present: the caller checked (curate: `require_extras`)

    with _quiet_ray() as level:
        started = False
        if not ray.is_initialized():
            if address:
                check_reachable(address)
            try:
                if address:
                    ray.init(address=address, log_to_driver=False, logging_level=level)
                else:
                    ray.init(num_cpus=cpus or workers, include_dashboard=False, log_to_driver=False, logging_level=level)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise ConfigError(f"cannot start or reach Ray ({address or 'local'}): {e}") from e
            started = True
        yield from _session(ray, started, workers, address)


@contextmanager
def _quiet_ray() -> Iterator[int]:
    """Ray's Python lines stay out of the terminal unless avatarstream logs at DEBUG (`-v`): its
    INFO on every dataset, its token and progress-bar notices (the level returned, for `ray.init`;
    Ray Data reconfigures its logger on every dataset, so through `RAY_DATA_LOG_LEVEL`). Ray's full
    logs stay in its session folder; its errors still reach the user as exceptions; a variable the
    user set is left as it is. Left alone: the core worker's C++ log, whose one error line on every
    run (Ray Data's actors keep their constructor arguments in the object store, ray#53727) only
    `RAY_BACKEND_LOG_LEVEL=fatal` hides, which would hide Ray's real errors too and prints a line
    of its own."""
    verbose = logging.getLogger("avatarstream").isEnabledFor(logging.DEBUG)
    quiet = {"RAY_DATA_LOG_LEVEL": "ERROR"}
    set_here = [] if verbose else [k for k in quiet if k not in os.environ]
    for k in set_here:
        os.environ[k] = quiet[k]
    try:
        yield logging.INFO if verbose else logging.ERROR
    finally:
        for k in set_here:
            os.environ.pop(k, None)


def _session(ray: Any, started: bool, workers: int, address: str | None) -> Iterator[None]:
    cpus = ray.cluster_resources().get("CPU", 0)
    if cpus < 1:
        if started:
            ray.shutdown()
        raise ConfigError(f"the Ray cluster ({address or 'local'}) has no CPU to run workers on")
    if workers > cpus:
        log.warning("%d workers asked, Ray has %g CPUs: at most %g run at once", workers, cpus, cpus)
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield
    finally:
        if started:
            ray.shutdown()
