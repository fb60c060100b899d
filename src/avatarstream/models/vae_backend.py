"""Optional faster backends for the causal VAE's streaming decode (`CausalVAE.decode_step`).

A steady-state chunk (the stream's third decode call onwards: the cache filled, and past the
first chunk's two parts) is one fixed computation: the latents
and every cached conv input go in, the frames and the new cache entries come out. `StreamStep`
is that computation as a plain function of tensors (the `ConvCache` entries as explicit inputs
and outputs, in a fixed key order), which is what a compiler or an exported graph needs. The
stream's first chunk (no cache: the temporal resamplers pass the first frame alone) and chunks
of a shape the backend has not prepared run eagerly, so a session's frames are the same
computation whatever the backend, up to float rounding.

Backends (`AVATARSTREAM_VAE_BACKEND`, read by `hardware.vae_backend`):

- `auto`: the `aoti` package of this model, chunk shape and CPU when one was built
  before (`avatarstream compile`, or any run with `aoti`), loaded in milliseconds; else eager.
  It never builds one itself.
- `eager` (default): `decode_step` as written.
- `aoti`: an AOTInductor package (`models/aot.py`: `torch.export`, compiled with `freezing`,
  kept on disk, one per shape); built on first use (≈ 40 s of one core for the bundled model,
  once per machine), loaded from disk afterwards. Under bf16 autocast the package is the step
  with bf16 weights and inputs (autocast does not export); fp32 otherwise.
- `compile`: `torch.compile` (inductor, `freezing` on: weights folded and prepacked for oneDNN),
  one graph per (shape, autocast dtype), `dynamic=False`, `fullgraph=True`; a later chunk of the
  same shape never recompiles. Compiling costs ≈ 30 s of one core per graph on first use.
- `openvino`: the step exported once to ONNX (`torch.onnx.export`) and compiled by OpenVINO
  (`pip install openvino onnx onnxscript`), f32, or bf16 inference precision when the call runs
  under bf16 autocast (as `Module.call` does where `hardware.bf16_is_fast`).
- `onnx`: the same export run by ONNX Runtime, f32 only.

Measured on one thread of a shared AVX512-bf16 CPU, the bundled model's steady chunk
([1, 16, 6, 32, 32] latents -> 24 frames at 256×256), ratios of times taken in one process:
compile 0.67 (fp32) / 0.64 (bf16) of eager; OpenVINO 0.79 / 0.80; ONNX Runtime 0.87 (fp32);
aoti 0.74 (fp32 and bf16, on the 2 threads of a loaded machine). Frames within 1 grey level of
eager in fp32, and within 4 under bf16 (where bf16 eager itself differs from fp32 eager by up to
3; the aoti bf16 package 3.5); `tests/models/test_vae_backend.py` holds the tolerances.
"""

from __future__ import annotations

import copy
import logging
import tempfile
from pathlib import Path
from collections.abc import Callable

import torch
from torch import nn

from avatarstream.cache.conv import ConvCache
from avatarstream.models import aot

log = logging.getLogger(__name__)

BACKENDS = ("auto", "eager", "aoti", "compile", "openvino", "onnx")
MAX_SHAPES = 2  # graphs built per backend: one chunk length, e.g. one session and a batch of two; others eager
_SOURCES = [Path(__file__).with_name(n) for n in ("vae.py", "vae_blocks.py", "vae_backend.py")] + [
    Path(__file__).parents[1] / "cache" / "conv.py"]


class StreamStep(nn.Module):
    """One steady-state `decode_step` as a function of tensors:
    (z [B, z, T, h, w], *cache frames in `keys` order) -> (video clamped, *new cache frames)."""

    def __init__(self, vae: nn.Module, keys: list[str]) -> None:
        super().__init__()
        self.vae, self.keys = vae, list(keys)

    def forward(self, z: torch.Tensor, *frames: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cache = ConvCache("decode")
        cache.frames = dict(zip(self.keys, frames))
        x = self.vae.decoder(self.vae.post_quant_conv(z), cache).clamp(-1.0, 1.0)
        return (x, *[cache.frames[k] for k in self.keys])


Runner = Callable[..., list[torch.Tensor]]


class DecodeBackend:
    """Runs a `CausalVAE`'s steady-state decode chunks through `kind` (see the module docstring)."""

    def __init__(self, vae: nn.Module, kind: str) -> None:
        if kind not in BACKENDS:
            raise ValueError(f"VAE backend must be one of {', '.join(BACKENDS)}, got {kind!r}")
        self.vae, self.kind = vae, kind
        self.runners: dict[tuple, Runner | None] = {}  # None: this shape decodes eagerly
        self.built: list[int] = []  # chunk lengths of the graphs built (compiled or exported) here
        self.digest: str | None = None  # the VAE's `aot.module_digest`, once needed

    def decode_step(self, z: torch.Tensor, cache: ConvCache) -> torch.Tensor | None:
        """The clamped frames of a steady-state chunk (cache updated), or None where the caller
        decodes eagerly (first chunk, an unprepared shape, the eager backend)."""
        if self.kind == "eager" or not cache.frames or cache.chunks < 2:
            return None  # a stream's first call fills the cache; its second may be the first
            # chunk's remainder (decode_publish sends a first frame ahead): steady from the third
        keys = sorted(cache.frames)
        bf16 = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        sig = (tuple(z.shape), z.device.type, bf16, tuple((k, tuple(cache.frames[k].shape)) for k in keys))
        if sig not in self.runners:
            self.runners[sig] = self._runner(sig, z, cache, keys, bf16)
        run = self.runners[sig]
        if run is None:
            return None
        out = run(z, *[cache.frames[k] for k in keys])
        cache.frames = dict(zip(keys, out[1:]))
        return out[0]

    def _runner(self, sig: tuple, z: torch.Tensor, cache: ConvCache, keys: list[str], bf16: bool) -> Runner | None:
        if z.device.type != "cpu":
            return None
        if self.kind in ("auto", "aoti"):
            if self.digest is None:  # the weights' hash, once (not on every new shape)
                self.digest = aot.module_digest(self.vae)
            key = aot.package_key(self.vae, _SOURCES, f"vae decode step {sig}", self.digest)
            run = aot.load(key)
            if run is not None and z.shape[2] not in self.built:
                self.built.append(z.shape[2])  # the session's chunk length: a tail is not built
            if run is None and self.kind == "aoti" and self._may_build(z):
                log.info("VAE backend aoti: compiling the decode step for latents %s%s (once per "
                         "machine)", tuple(z.shape), " (bf16)" if bf16 else "")
                with torch.inference_mode(False):  # bf16 copies that export can trace
                    vae = copy.deepcopy(self.vae, {id(self): self}).to(torch.bfloat16) if bf16 else self.vae
                step = StreamStep(vae, keys).eval()
                dtype = torch.bfloat16 if bf16 else torch.float32
                run = aot.build(key, step, (z.to(dtype), *[cache.frames[k].to(dtype) for k in keys]))
            return None if run is None else _cast_inputs(run, torch.bfloat16 if bf16 else torch.float32)
        # one chunk length (the session's; a stream's short tail chunk decodes eagerly rather
        # than paying a compile), at most MAX_SHAPES batch sizes
        return self._prepare(z, cache, keys, bf16) if self._may_build(z) else None

    def _may_build(self, z: torch.Tensor) -> bool:
        if len(self.built) >= MAX_SHAPES or any(t != z.shape[2] for t in self.built):
            return False
        self.built.append(z.shape[2])
        return True

    def _prepare(self, z: torch.Tensor, cache: ConvCache, keys: list[str], bf16: bool) -> Runner:
        step = StreamStep(self.vae, keys).eval()
        log.info("VAE backend %s: preparing the decode step for latents %s%s", self.kind,
                 tuple(z.shape), " (bf16)" if bf16 else "")
        if self.kind == "compile":
            import torch._inductor.config as inductor_config

            inductor_config.freezing = True  # weights as constants, prepacked for oneDNN (CPU)
            fn = torch.compile(step, dynamic=False, fullgraph=True)
            return lambda *a: list(fn(*a))
        args = (z.float(), *[cache.frames[k].float() for k in keys])
        buf = _export_onnx(step, args)
        if self.kind == "onnx":
            return _onnx_runtime(buf)
        return _openvino(buf, bf16)


def _cast_inputs(run: Runner, dtype: torch.dtype) -> Runner:
    """`run` with every input cast to the package's dtype (the stream's first, eager chunk leaves
    cache entries of mixed dtypes under autocast)."""
    return lambda *a: run(*[t.to(dtype) for t in a])


def _export_onnx(step: StreamStep, args: tuple) -> bytes:
    """The step as ONNX bytes, traced in fp32 without autocast (the runtime picks the precision)."""
    try:
        import onnx  # noqa: F401  (torch.onnx.export needs onnx and onnxscript)
        import onnxscript  # noqa: F401
    except ImportError as e:
        raise RuntimeError("the onnx/openvino VAE backends need `pip install onnx onnxscript` "
                           f"({e})") from e
    with torch.autocast("cpu", enabled=False), torch.inference_mode(False), torch.no_grad():
        args = tuple(a.clone() for a in args)  # ordinary tensors: export refuses inference tensors
        prog = torch.onnx.export(step, args, dynamo=True, verbose=False,
                                 input_names=["z"] + [f"cache{i}" for i in range(len(args) - 1)],
                                 output_names=["video"] + [f"next{i}" for i in range(len(args) - 1)])
    return prog.model_proto.SerializeToString()


def _numpy_inputs(tensors: tuple) -> list:
    return [t.detach().float().contiguous().numpy() for t in tensors]


def _onnx_runtime(model: bytes) -> Runner:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]

    def run(*tensors: torch.Tensor) -> list[torch.Tensor]:
        return [torch.from_numpy(o) for o in sess.run(None, dict(zip(names, _numpy_inputs(tensors))))]

    return run


def _openvino(model: bytes, bf16: bool) -> Runner:
    try:
        import openvino as ov
    except ImportError as e:
        raise RuntimeError(f"the openvino VAE backend needs `pip install openvino` ({e})") from e
    core = ov.Core()
    with tempfile.TemporaryDirectory(prefix="avatarstream-vae-") as tmp:
        (Path(tmp) / "step.onnx").write_bytes(model)
        graph = core.read_model(str(Path(tmp) / "step.onnx"))
    compiled = core.compile_model(graph, "CPU", {
        "INFERENCE_NUM_THREADS": torch.get_num_threads(), "PERFORMANCE_HINT": "LATENCY",
        "INFERENCE_PRECISION_HINT": "bf16" if bf16 else "f32"})
    request = compiled.create_infer_request()

    def run(*tensors: torch.Tensor) -> list[torch.Tensor]:
        res = request.infer(_numpy_inputs(tensors))
        return [torch.from_numpy(res[o].copy()) for o in compiled.outputs]

    return run
