"""The engine's LiveAvatar denoiser (engine/liveavatar.py) computes the official streaming loop.

On the `liveavatar-dit` fixtures (the official `CausalWanModel_S2V` run by its pipeline: sink
prefills, blocks × Euler steps, one ring per step), the denoiser the engine runs, given the
fixture's inputs and its pinned sink distance, lands on the official latents within the family's
parity bound (1e-5, fp32; measured 1.43e-6 on -a and 1.19e-6 on -b, AMD EPYC: 7x under it); split
over two step shares (TPP, here in one process) it is the same computation, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from avatarstream.engine.liveavatar import SIGMAS, LiveAvatarDenoiser, sink_distance
from avatarstream.engine.module import Module
from avatarstream.parity.fixture import FAMILY_TOLERANCE, load_fixture
from avatarstream.parity.liveavatar_dit import load

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden"


def _run(fx, shares: list[list[int]]) -> torch.Tensor:
    s = fx.settings
    assert [round(v, 6) for v in s["sigmas"]] == list(SIGMAS)
    dit = Module("dit", load(fx))
    fpb, ring = int(s["frames_per_block"]), int(s["kv_ring_frames"])
    dens = [LiveAvatarDenoiser(dit, block=fpb, ring_blocks=ring // fpb, seed=0, steps=steps,
                               sigmas=s["sigmas"], aas_block=None,
                               distance=lambda b: int(s["sink_distance"])) for steps in shares]
    for d in dens:
        d.start(fx.inputs["ref_latents"], fx.inputs["motion_latents"], fx.inputs["context"])
    audio, noise = fx.inputs["audio"], fx.inputs["noise"]
    per = audio.shape[-1] // noise.shape[0]
    out = []
    for b in range(noise.shape[0]):
        x = noise[b][None]
        for d in dens:
            x = d.denoise(x, audio[..., per * b : per * (b + 1)], b)
        out.append(x[0])
    return torch.stack(out)


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("liveavatar-dit-*.safetensors")), ids=lambda p: p.name)
def test_denoiser_reproduces_the_official_stream(path):
    fx = load_fixture(path)
    with torch.inference_mode():
        whole = _run(fx, [[0, 1, 2, 3]])
        split = _run(fx, [[0, 1], [2, 3]])
    assert float((whole - fx.expected["latents"]).abs().max()) <= FAMILY_TOLERANCE["liveavatar-dit"]
    assert torch.equal(whole, split)


def test_sink_distance_is_seeded_per_block_in_the_official_range():
    a = [sink_distance(7, b) for b in range(50)]
    assert a == [sink_distance(7, b) for b in range(50)]  # every process draws the same d
    assert a != [sink_distance(8, b) for b in range(50)]
    assert min(a) >= 4 and max(a) <= 30 and len(set(a)) > 5
