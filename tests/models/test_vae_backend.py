"""The causal VAE's optional decode backends (`models/vae_backend.py`) against eager decode.

Tolerances (uint8 frames of a stream decoded chunk by chunk, the cache carried across chunks):
fp32 within 1 grey level of eager. Under bf16 the backend must be no farther from fp32 eager than
bf16 eager is (max + 1 grey level, mean + 10 %): on this tiny random model bf16 eager itself
drifts ≈ 30 grey levels from fp32 (on the bundled model: ≤ 3, and backend vs bf16 eager ≤ 4).
A steady chunk of the same shape never recompiles.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from avatarstream.engine.stages.decode_publish import to_uint8_frames
from avatarstream.errors import ConfigError
from avatarstream.hardware import vae_backend
from avatarstream.models.vae import CausalVAE, VAEConfig

FP32_GREY = 1


def _vae() -> CausalVAE:
    return CausalVAE(VAEConfig.tiny()).init_random_(3).eval()


def _latents() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 4, t, 8, 8, generator=g) for t in (3, 2, 2, 2, 1)]  # first, steady ×3, tail


def _stream(vae: CausalVAE, bf16: bool) -> list[np.ndarray]:
    cache = vae.new_cache()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return [to_uint8_frames(vae.decode_step(z, cache)[0]) for z in _latents()]


def _grey(a: list[np.ndarray], b: list[np.ndarray]) -> tuple[int, float]:
    """(max, mean) absolute difference in grey levels over all frames."""
    assert [x.shape for x in a] == [y.shape for y in b]
    d = [np.abs(x.astype(np.int16) - y.astype(np.int16)) for x, y in zip(a, b)]
    return max(int(x.max()) for x in d), float(np.mean([x.mean() for x in d]))


def _max_grey(a: list[np.ndarray], b: list[np.ndarray]) -> int:
    return _grey(a, b)[0]


def _check(kind: str, bf16: bool, tol: int) -> CausalVAE:
    vae = _vae()
    ref = _stream(vae, bf16)
    vae.set_decode_backend(kind)
    got = _stream(vae, bf16)
    assert _max_grey(ref, got) <= tol
    # only the steady shape went through the backend: the first and the tail chunk stay eager
    assert len(vae.decode_backend.runners) == 1
    return vae


def test_compile_matches_eager_and_never_recompiles():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    _check("compile", False, FP32_GREY)
    assert counters["stats"]["unique_graphs"] == 1  # 3 steady chunks, one graph, no recompile
    assert not counters["recompiles"]


@pytest.mark.parametrize("kind", ["openvino", "onnx"])
def test_exported_runtimes_match_eager(kind):
    need = ["onnx", "onnxscript", "openvino" if kind == "openvino" else "onnxruntime"]
    missing = [m for m in need if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the {kind} VAE backend needs {', '.join(missing)}")
    _check(kind, False, FP32_GREY)
    if kind == "openvino":  # bf16 inference precision under bf16 autocast
        vae = _vae()
        fp32, bf16_eager = _stream(vae, False), _stream(vae, True)
        vae.set_decode_backend(kind)
        got = _stream(vae, True)
        (m_ref, a_ref), (m_got, a_got) = _grey(fp32, bf16_eager), _grey(fp32, got)
        assert m_got <= m_ref + 1 and a_got <= 1.1 * a_ref


def test_eager_backend_and_clamp_false_stay_eager():
    vae = _vae()
    vae.set_decode_backend("eager")
    assert vae.decode_backend is None
    vae.set_decode_backend("onnx")
    cache = vae.new_cache()
    with torch.inference_mode():
        for z in _latents()[:2]:
            vae.decode_step(z, cache, clamp=False)  # unclamped output: the eager path, nothing exported
    assert vae.decode_backend.runners == {}


def test_backend_setting(monkeypatch):
    monkeypatch.delenv("AVATARSTREAM_VAE_BACKEND", raising=False)
    assert vae_backend() == "eager"
    monkeypatch.setenv("AVATARSTREAM_VAE_BACKEND", " Compile ")
    assert vae_backend() == "compile"
    monkeypatch.setenv("AVATARSTREAM_VAE_BACKEND", "tensorrt")
    with pytest.raises(ConfigError, match="AVATARSTREAM_VAE_BACKEND"):
        vae_backend()
