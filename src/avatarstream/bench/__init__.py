"""Benchmarks: `avatarstream bench NAME [--json]`. Each prints one JSON object on its last line.

A benchmark is a module in this package exposing::

    HELP: str
    def add_arguments(parser: argparse.ArgumentParser) -> None
    def run(args: argparse.Namespace) -> dict   # what it measured; JSON-serialisable

Names and keys are stable once published.
"""

BENCHMARKS: dict[str, str] = {
    "engine": "avatarstream.bench.engine",
    "memory": "avatarstream.bench.memory",
    "attention": "avatarstream.bench.attention",
    "cache": "avatarstream.bench.cache",
    "vae": "avatarstream.bench.vae",
    "synth": "avatarstream.bench.synth",
    "sessions": "avatarstream.bench.sessions",
    "realtime": "avatarstream.bench.realtime",
    "tpp": "avatarstream.bench.tpp",
    "drift": "avatarstream.bench.drift",
    "strategies": "avatarstream.bench.strategies",
    "switch": "avatarstream.bench.switch",
    "soak": "avatarstream.bench.soak",
    "server-soak": "avatarstream.bench.server_soak",
    "watermark": "avatarstream.bench.watermark",
    "listening": "avatarstream.bench.listening",
    "batch": "avatarstream.bench.batch",
}
