"""What each pipeline rank loads (`parallel/roles.py`): only its networks, with the weights the
whole model has, and a reference on the ranks without a DiT equal to the full one's."""

from __future__ import annotations

import pytest
import torch

from avatarstream.engine.session import SessionState
from avatarstream.engine.stages.reference import ReferenceStage
from avatarstream.parallel.roles import NotLoaded, RankReference, loaded_parts, rank_models, role_of
from avatarstream.registry import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_roles():
    assert [role_of(r, 2, False) for r in range(3)] == ["denoise", "denoise", "decode"]
    assert [role_of(r, 1, True) for r in range(3)] == ["denoise", "refine", "publish"]


def test_each_rank_loads_its_parts_with_the_same_weights():
    full = load_model("tiny-random")
    den, dec = rank_models("tiny-random", "denoise"), rank_models("tiny-random", "decode")
    assert loaded_parts(den) == ["dit", "vae", "audio", "text"] and den.refiner is None
    assert loaded_parts(dec) == ["refiner", "vae", "audio", "text"] and isinstance(dec.dit, NotLoaded)
    assert loaded_parts(rank_models("tiny-random", "publish")) == ["vae", "audio", "text"]
    for name, mine in (("dit", den.dit), ("refiner", dec.refiner), ("vae", dec.vae)):
        want = getattr(full, name).model.state_dict()
        got = mine.model.state_dict()
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    with pytest.raises(RuntimeError, match="decode rank does not load the dit"):
        dec.dit.call("encode_reference")


def test_rank_reference_equals_the_full_reference():
    full, dec = load_model("tiny-random"), rank_models("tiny-random", "decode")
    c = full.config
    g = torch.Generator().manual_seed(0)
    frames = (torch.rand(5, 3, 64, 64, generator=g) * 255).to(torch.uint8)
    frames[1:5] = 0  # a blank latent frame: masked in the refiner's keys
    a, b = SessionState(), SessionState()
    ReferenceStage(full.dit, full.refiner, full.vae, full.text, lr_size=c.lr_size,
                   ref_t_position=c.ref_t_position).run(a, frames, "hello")
    with torch.inference_mode():
        RankReference(dec, dec.config).run(b, frames, "hello")
    ra, rb = a.refiner_reference, b.refiner_reference
    assert all(torch.equal(x, y) for x, y in zip(ra.k + ra.v, rb.k + rb.v))
    assert torch.equal(a.text, b.text) and b.dit_reference is None
