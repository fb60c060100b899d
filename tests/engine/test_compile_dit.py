"""`generate --compile`: the DiT's denoising step through torch.compile (inductor) against eager,
for our tiny model and the tiny FlashHead and LiveAvatar folders in the official layout.

Tolerance: frames within 2 grey levels (fp32; inductor fuses and reorders float sums, measured
max 1). A second stream of the same shapes compiles nothing more: no recompile in a session.
(Our DiT has graph breaks at `.item()` calls, 5 a step: pieces, not recompiles; FlashHead none.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from avatarstream.engine.module import DIT_STEP_METHODS
from avatarstream.engine.pipeline import Pipeline
from avatarstream.eval.benchmark import CollectSink
from avatarstream.registry import load_model
from avatarstream.weights import flashhead_folder, liveavatar_folder

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")]


def _frames(models) -> np.ndarray:
    g = torch.Generator().manual_seed(0)
    h, w = models.config.out_hw
    ref = (torch.rand(1, 3, h, w, generator=g) * 255).to(torch.uint8)
    wave = 0.1 * torch.randn(16000 * 3, generator=g)
    sink = CollectSink()
    Pipeline(models).run(ref, iter(wave.split(3200)), [sink])
    return np.stack(sink.frames).astype(np.int16)


def _name(family: str, tmp_path) -> str:  # noqa: ANN001
    if family == "flashhead":
        return f"flashhead-pro:{flashhead_folder.write_official_folder(tmp_path / 'SoulX-FlashHead-1_3B')}"
    if family == "liveavatar":
        return f"liveavatar:{liveavatar_folder.write_official_folder(tmp_path / 'ckpt')}"
    return family


# LiveAvatar's block step compiles in ≈ 3 minutes of one core here: it runs in `make test`'s
# second pytest, alongside the rest (marker soak)
@pytest.mark.parametrize("family", ["tiny-random", "flashhead",
                                    pytest.param("liveavatar", marks=pytest.mark.soak)])
def test_compiled_dit_matches_eager_and_does_not_recompile(family, tmp_path):
    from torch._dynamo.utils import counters

    name = _name(family, tmp_path)
    eager = _frames(load_model(name, bf16=False))
    models = load_model(name, bf16=False)
    assert "forward" in models.dit.compile(DIT_STEP_METHODS)
    torch._dynamo.reset()
    counters.clear()
    got = _frames(models)
    assert got.shape == eager.shape and np.abs(got - eager).max() <= 2
    graphs = counters["stats"]["unique_graphs"]  # per chunk shape, and per piece between graph breaks
    assert np.array_equal(_frames(models), got)  # a second stream: the same graphs, the same frames
    assert counters["stats"]["unique_graphs"] == graphs and not counters["recompiles"]
