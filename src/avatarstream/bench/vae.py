"""`bench vae`: streaming vs whole-sequence causal-VAE decode — equality and bounded memory.

`--seconds` of video (default 60 s at 25 fps: 1+4k ≈ 1501 frames ↔ 376 latent frames) of random
latents, decoded by the tiny VAE (`VAEConfig.tiny()`, random weights) at 64×64. The tiny config
at 64×64 is what keeps the *whole-sequence* decode, which holds every activation of all 1501
frames at once (≈ 0.1 GB per 16-channel activation at 32×32, the top level after the 2×2 pixel
patch; ≈ 0.6 GB peak in all), inside this machine's memory; the streaming path does not need that
and is what the engine uses.

Three measurements, each in its own fresh subprocess (`python -m avatarstream.bench.vae
--worker MODE`) so that no allocator state is shared:

- `whole`:  `vae.decode(z)` of all latent frames at once; frames written to a raw file.
- `stream`: `vae.decode_step` chunk by chunk (`--chunk` latent frames, default 8) with one
  ConvCache; each chunk's frames are written to a raw file and dropped before the next chunk,
  as a real streaming consumer (the fMP4 publisher) does.
- `chunk`:  a single steady-state chunk: latent frame 0 alone (1 video frame, a small step that
  only primes the cache), then one chunk of `--chunk` latent frames (4·chunk video frames).

Memory is the *peak extra resident memory* of the measured phase: after the model, the latents
and a warm-up decode (loads kernels) the worker resets the kernel's peak-RSS mark
(`/proc/self/clear_refs` ← 5, Linux ≥ 4.0) and records the current RSS; the peak is VmHWM read
afterwards (fallback where that is unavailable: `resource.getrusage().ru_maxrss`). extra =
peak − baseline. `peak_mem_ratio` = stream extra / chunk extra (target ≤ 1.1: streaming 60 s
costs no more memory than one chunk). `max_abs_diff` compares the two written files
(whole vs stream; fp32, target ≤ 1e-4).

Allocator (`--malloc`): with glibc's default *dynamic* mmap threshold, every freed large block
raises the threshold (up to 32 MiB), after which a chunk's activations (≈ 2 MiB each here) come
from the brk heap, which keeps freed memory resident and fragments: RSS then plateaus above one
chunk's peak after the first chunks (bounded, not growing with the number of chunks; measured
60 s: stream 32 MB vs chunk 23 MB, ratio ≈ 1.4). `--malloc pinned` (default) runs the workers
with `MALLOC_MMAP_THRESHOLD_=1048576`, which pins the threshold so large tensors are mmap'd and
given back on free: RSS then tracks the live tensors (measured 60 s: 16 MB vs 18 MB, ratio ≈
0.92), at the price of page faults (streaming fps ≈ 2× lower at this tiny size). A serving
process that wants the tight bound should run with the same setting (or jemalloc/tcmalloc);
`--malloc default` measures glibc as is.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HELP = "streaming vs whole causal-VAE decode of 60 s: max abs diff and peak-memory ratio"

FPS = 25
SIZE = 64  # tiny config's resolution (latent 8×8)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds of video to decode")
    parser.add_argument("--chunk", type=int, default=8, help="latent frames per decode_step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--malloc", choices=("pinned", "default"), default="pinned",
                        help="pinned: workers run with MALLOC_MMAP_THRESHOLD_=1 MiB (see module "
                             "docstring); default: glibc's dynamic threshold")
    parser.add_argument("--quick", action="store_true",
                        help="2 s of video instead of --seconds, the three workers run "
                             "concurrently (smoke test: memory numbers valid, fps not)")


def latent_frames(seconds: float, fps: int = FPS) -> int:
    """Latent frames T of a 1+4k-frame video of about `seconds`: k = round(seconds·fps/4), T = 1+k."""
    return 1 + max(1, round(seconds * fps / 4))


# -- worker (runs in a fresh process) ---------------------------------------------------------------
def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_kb(reset_ok: bool) -> int:
    if reset_ok:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux


def _worker(mode: str, latents: int, chunk: int, seed: int, out: str | None) -> dict:
    import torch

    from avatarstream.models.vae import CausalVAE, VAEConfig

    vae = CausalVAE(VAEConfig.tiny()).init_random_(seed).eval()
    g = torch.Generator().manual_seed(seed + 1)
    z = torch.randn(1, vae.cfg.z_channels, latents, SIZE // 8, SIZE // 8, generator=g)
    sink = open(out, "wb") if out else None
    cache_nbytes = 0
    with torch.inference_mode():
        vae.decode_step(z[:, :, :2], vae.new_cache())  # warm-up: kernels, thread pool
        gc.collect()
        reset_ok = _reset_peak()
        base = _rss_kb()
        t0 = time.perf_counter()
        if mode == "whole":
            frames = vae.decode(z)  # [1, 3, F, H, W]
            sink.write(frames[0].transpose(0, 1).contiguous().numpy().tobytes())
            del frames
        elif mode == "stream":
            cache = vae.new_cache()
            for s in range(0, latents, chunk):
                frames = vae.decode_step(z[:, :, s:s + chunk], cache)  # [1, 3, f, H, W]
                sink.write(frames[0].transpose(0, 1).contiguous().numpy().tobytes())
                del frames  # dropped before the next chunk, like a real consumer
            cache_nbytes = cache.nbytes()
        elif mode == "chunk":
            cache = vae.new_cache()
            vae.decode_step(z[:, :, :1], cache)
            frames = vae.decode_step(z[:, :, 1:1 + chunk], cache)
            del frames
            cache_nbytes = cache.nbytes()
        else:
            raise ValueError(f"unknown worker mode {mode!r}")
        seconds = time.perf_counter() - t0
    peak = _peak_kb(reset_ok)
    if sink is not None:
        sink.close()
    return {"mode": mode, "base_kb": base, "peak_kb": peak, "extra_kb": max(peak - base, 0),
            "seconds": seconds, "cache_nbytes": cache_nbytes, "hwm_reset": reset_ok}


MMAP_THRESHOLD = 1 << 20  # bytes; glibc allocations above this are mmap'd and returned on free


def _start(mode: str, latents: int, chunk: int, seed: int, out: Path | None,
           malloc: str) -> subprocess.Popen:
    """Start one worker in a fresh process."""
    cmd = [sys.executable, "-m", "avatarstream.bench.vae", "--worker", mode,
           "--latents", str(latents), "--chunk", str(chunk), "--seed", str(seed)]
    if out is not None:
        cmd += ["--out", str(out)]
    env = dict(os.environ)
    if malloc == "pinned":
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finish(mode: str, proc: subprocess.Popen) -> dict:
    """Wait for a worker and return its JSON line."""
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"bench vae worker {mode} failed: {stderr[-2000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def _max_abs_diff(a: Path, b: Path, frame_floats: int) -> float:
    """Max |a − b| over two raw float32 frame files, compared frame block by frame block."""
    x = np.memmap(a, dtype=np.float32, mode="r")
    y = np.memmap(b, dtype=np.float32, mode="r")
    if x.shape != y.shape:
        raise RuntimeError(f"whole and streaming decodes differ in length: {x.size} vs {y.size}")
    step = frame_floats * 64
    return float(max((np.abs(x[i:i + step] - y[i:i + step]).max() for i in range(0, x.size, step)),
                     default=0.0))


def run(args: argparse.Namespace) -> dict:
    seconds = 2.0 if args.quick else float(args.seconds)
    latents = latent_frames(seconds)
    frames = 1 + 4 * (latents - 1)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        jobs = [("whole", tmp / "whole.f32"), ("stream", tmp / "stream.f32"), ("chunk", None)]
        res: dict[str, dict] = {}
        if args.quick:  # concurrent: peak RSS is per process; only the fps numbers share CPUs
            procs = [(m, _start(m, latents, args.chunk, args.seed, o, args.malloc))
                     for m, o in jobs]
            res = {m: _finish(m, p) for m, p in procs}
        else:
            for m, o in jobs:
                res[m] = _finish(m, _start(m, latents, args.chunk, args.seed, o, args.malloc))
        whole, stream, chunk = res["whole"], res["stream"], res["chunk"]
        diff = _max_abs_diff(tmp / "whole.f32", tmp / "stream.f32", 3 * SIZE * SIZE)
    mb = 1024.0
    return {
        "config": "tiny",
        "size": SIZE,
        "seconds": seconds,
        "frames": frames,
        "latent_frames": latents,
        "chunk": args.chunk,
        "max_abs_diff": diff,
        "peak_mem_ratio": round(stream["extra_kb"] / max(chunk["extra_kb"], 1), 4),
        "stream_peak_mb": round(stream["extra_kb"] / mb, 2),
        "chunk_peak_mb": round(chunk["extra_kb"] / mb, 2),
        "whole_peak_mb": round(whole["extra_kb"] / mb, 2),
        "cache_nbytes": stream["cache_nbytes"],
        "stream_fps": round(frames / stream["seconds"], 1),
        "whole_fps": round(frames / whole["seconds"], 1),
        "memory_method": "VmHWM after clear_refs" if stream["hwm_reset"] else "ru_maxrss",
        "malloc": args.malloc,
    }


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="bench vae worker (one measurement per process)")
    p.add_argument("--worker", required=True, choices=("whole", "stream", "chunk"))
    p.add_argument("--latents", type=int, required=True)
    p.add_argument("--chunk", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    print(json.dumps(_worker(a.worker, a.latents, a.chunk, a.seed, a.out)))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
