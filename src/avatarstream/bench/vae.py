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

`--wan` adds the Wan2.1 VAE (FlashHead Pro's and LiveAvatar's) at its real width (dim 96, random
weights, fp32) under the key "wan", at 256² and 512² (`--wan-sizes`), in the same fresh-process
workers: `wan-whole` is `vae.decode(z)` of all latents at once, the official whole decode (which
itself goes latent by latent through a fresh cache and concatenates); `wan-stream` is
`decode_step` one latent at a time with one cache, each chunk's frames written out and dropped, as
the engine streams. Streaming runs at two durations (`--wan-latents`, default 2 and 3 latents: 5
and 9 frames, the shortest that show a peak independent of duration: every latent after the
first decodes the same 4 frames with the same cache), the whole decode at the longer one. Reported per size: `fps_ratio` = stream fps /
whole fps at the longer duration (target ≥ 0.8), `stream_peak_mb` at both durations and
`peak_growth` (longer / shorter; flat ≈ 1), `whole_peak_mb`, and `max_abs_diff` (whole vs stream,
expected 0: the same operations). At 512² a latent costs several TFLOP, so on a 2-core CPU the
section takes minutes; it is off by default for that reason.
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

HELP = ("streaming vs whole causal-VAE decode of 60 s: max abs diff and peak-memory ratio "
        "(--wan: also the Wan2.1 VAE at 256² and 512²)")

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
    parser.add_argument("--wan", action="store_true",
                        help="also the Wan2.1 VAE at its real width (slow on a CPU: minutes)")
    parser.add_argument("--wan-sizes", type=int, nargs="+", default=[256, 512], metavar="PX",
                        help="--wan: frame sizes (multiples of 8)")
    parser.add_argument("--wan-latents", type=int, nargs=2, default=[2, 3], metavar=("SHORT", "LONG"),
                        help="--wan: latent frames of the two streaming durations (the whole decode "
                             "runs the longer)")


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


def _worker(mode: str, latents: int, chunk: int, seed: int, out: str | None, model: str = "tiny",
            size: int = SIZE) -> dict:
    import torch

    if model == "wan":  # the Wan2.1 VAE at its real width; PyTorch's default init drawn from `seed`
        from avatarstream.models.wan.vae import WanVAE, WanVAEConfig

        torch.manual_seed(seed)
        vae = WanVAE(WanVAEConfig()).eval()
        z_channels, warm = vae.cfg.z_dim, 1  # warm up on the first latent alone (1 frame: cheap)
    else:
        from avatarstream.models.vae import CausalVAE, VAEConfig

        vae = CausalVAE(VAEConfig.tiny()).init_random_(seed).eval()
        z_channels, warm = vae.cfg.z_channels, 2
    g = torch.Generator().manual_seed(seed + 1)
    z = torch.randn(1, z_channels, latents, size // 8, size // 8, generator=g)
    sink = open(out, "wb") if out else None
    cache_nbytes = 0
    with torch.inference_mode():
        vae.decode_step(z[:, :, :warm], vae.new_cache())  # warm-up: kernels, thread pool
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
           malloc: str, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """Start one worker in a fresh process (`extra`: more worker arguments, e.g. the model)."""
    cmd = [sys.executable, "-m", "avatarstream.bench.vae", "--worker", mode,
           "--latents", str(latents), "--chunk", str(chunk), "--seed", str(seed), *extra]
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
    result = {
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
    if getattr(args, "wan", False):
        result["wan"] = _run_wan(args)
    return result


def _run_wan(args: argparse.Namespace) -> dict:
    """The Wan2.1 VAE section (see the module docstring): per size, streaming at two durations
    and the whole decode at the longer, each in a fresh worker, one after another (timings)."""
    short, long = args.wan_latents
    sizes: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for size in args.wan_sizes:
            extra = ("--model", "wan", "--size", str(size))
            runs = {name: _finish(f"wan {name}", _start(mode, t, 1, args.seed, tmp / f"{name}.f32",
                                                        args.malloc, extra))
                    for name, mode, t in (("short", "stream", short), ("stream", "stream", long),
                                          ("whole", "whole", long))}
            s1, s2, whole = runs["short"], runs["stream"], runs["whole"]
            frames = 1 + 4 * (long - 1)
            sizes[str(size)] = {
                "frames": [1 + 4 * (short - 1), frames],
                "stream_fps": round(frames / s2["seconds"], 3),
                "whole_fps": round(frames / whole["seconds"], 3),
                "fps_ratio": round(whole["seconds"] / s2["seconds"], 3),
                "stream_peak_mb": [round(s1["extra_kb"] / 1024, 1), round(s2["extra_kb"] / 1024, 1)],
                "peak_growth": round(s2["extra_kb"] / max(s1["extra_kb"], 1), 3),
                "whole_peak_mb": round(whole["extra_kb"] / 1024, 1),
                "cache_mb": round(s2["cache_nbytes"] / 2**20, 1),
                "max_abs_diff": _max_abs_diff(tmp / "whole.f32", tmp / "stream.f32", 3 * size * size),
            }
    return {"config": "wan2.1 (dim 96, z 16), random weights, fp32", "chunk": 1,
            "latent_frames": [short, long], "sizes": sizes}


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="bench vae worker (one measurement per process)")
    p.add_argument("--worker", required=True, choices=("whole", "stream", "chunk"))
    p.add_argument("--latents", type=int, required=True)
    p.add_argument("--chunk", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--model", choices=("tiny", "wan"), default="tiny")
    p.add_argument("--size", type=int, default=SIZE)
    a = p.parse_args(argv)
    print(json.dumps(_worker(a.worker, a.latents, a.chunk, a.seed, a.out, a.model, a.size)))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
