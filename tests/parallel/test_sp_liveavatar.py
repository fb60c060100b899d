"""Sequence parallelism for LiveAvatar's streaming DiT (`parallel/sp_liveavatar.py`) over real
`torchrun --standalone` gloo processes, float32 on the CPU.

- The denoiser (6 blocks x 4 Euler steps, a ring of 2 blocks per step that wraps from block 2,
  the Adaptive Attention Sink before block 4, seeded sink distances, 35 tokens a frame: padded on
  2 and 4 ranks) equals the single-process denoiser within 1e-5 absolute on latents of magnitude
  ~5 (measured 6e-7 on 2 ranks, 7e-7 on 4: float32 rounding of matmuls over other row counts),
  the rings and the sink holding one head per rank.
- `torchrun -m avatarstream.parallel.launch generate --sequence-parallel --model liveavatar:DIR`
  on 2 ranks writes the MP4 from latents equal to single-process `generate`'s within 1e-5
  (measured 0: at 16 tokens a frame, no padding, the float32 results come out bit for bit).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import av
import pytest
import torch

from avatarstream.errors import ConfigError

sys.path.insert(0, str(Path(__file__).parent))
from sp_liveavatar_run import recorded_latents, rollout, tiny_dit  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-5
HELPER = Path(__file__).parent / "sp_liveavatar_run.py"


def _torchrun(world: int, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(HELPER), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "AVATARSTREAM_BF16": "0"})
    assert r.returncode == 0, r.stderr[-3000:]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b) and all(x.shape == y.shape for x, y in zip(a, b))
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("world", [2, 4])
def test_denoiser_sequence_parallel_equals_single_process(world: int, tmp_path: Path) -> None:
    heads = world  # the tiny config's 2 heads over 2 ranks; a 4-head one (width 64) over 4
    with torch.inference_mode():
        plain, ring_heads, sink_heads = rollout(parallel=False, heads=heads)
    _torchrun(world, "denoise", str(heads), str(tmp_path / "sp.pt"))
    got, sp_ring_heads, sp_sink_heads = torch.load(tmp_path / "sp.pt")
    assert (ring_heads, sink_heads) == (heads, heads)
    assert (sp_ring_heads, sp_sink_heads) == (1, 1)  # rings and sink: this rank's heads only
    diff = _max_diff(got, plain)
    assert diff <= TOL, f"max abs diff {diff:.3g}"
    print(f"LiveAvatar SP over {world}: max abs diff {diff:.3g}")


def test_heads_must_divide() -> None:
    from avatarstream.parallel.sp_liveavatar import SequenceParallelLiveAvatar
    from avatarstream.parallel.ulysses import SPGroup

    with pytest.raises(ConfigError, match="divisible by 4"):
        SequenceParallelLiveAvatar(tiny_dit(2), SPGroup(rank=0, world=4))


def test_a_rank_holds_its_share_of_every_frame() -> None:
    """35 tokens a frame over 2 ranks: 18 each, the last rank's padded with the frame's last token."""
    from avatarstream.parallel.sp_liveavatar import FrameShard
    from avatarstream.parallel.ulysses import SPGroup

    tokens = torch.arange(3 * 35.0).view(1, 3, 35, 1)  # [B, F, P, D]
    first, last = (FrameShard(SPGroup(rank=r, world=2), 35).take(tokens) for r in (0, 1))
    assert first.shape == last.shape == (1, 3, 18, 1)
    assert torch.equal(first[0, :, :, 0], tokens[0, :, :18, 0])
    assert torch.equal(last[0, :, :17, 0], tokens[0, :, 18:, 0])
    assert torch.equal(last[0, :, 17, 0], tokens[0, :, 34, 0])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:  # noqa: ANN001
    from avatarstream.weights.liveavatar_folder import write_official_folder

    return write_official_folder(tmp_path_factory.mktemp("la") / "ckpt")  # with a prompt context


def test_generate_sequence_parallel_equals_single_process(folder: Path, tmp_path: Path) -> None:
    """2 s of speech: 5 blocks (the sink swapped before block 4), 50 frames in the MP4."""
    from avatarstream.engine.pipeline import Pipeline
    from avatarstream.eval.benchmark import CollectSink
    from avatarstream.media.audio import AudioReader
    from avatarstream.media.image import write_png
    from avatarstream.media.reference import load_reference
    from avatarstream.media.synthetic import face_image, speechlike, write_wav
    from avatarstream.registry import load_model

    png = write_png(tmp_path / "ref.png", face_image(128))
    wav = write_wav(tmp_path / "s.wav", speechlike(2.0))
    out = tmp_path / "sp.mp4"
    _torchrun(2, "generate", str(tmp_path / "lat.pt"), "generate", "--sequence-parallel",
              "--model", f"liveavatar:{folder}", "--strategy", "causal", "--reference", str(png),
              "--audio", str(wav), "--out", str(out), "--no-progress", "--threads", "1")
    got, sp_heads = torch.load(tmp_path / "lat.pt")
    with av.open(str(out)) as f:
        assert sum(1 for _ in f.decode(video=0)) == 50

    models = load_model(f"liveavatar:{folder}", bf16=False)
    ref = load_reference(str(png), size=models.config.out_hw, max_frames=models.config.ref_pixel_frames)
    with recorded_latents() as want:
        summary = Pipeline(models).run(ref.frames, iter(AudioReader(str(wav))), [CollectSink()])
    heads = models.dit.model.config.num_heads
    assert summary.frames == 50 and len(want.latents) == 5 and want.ring_heads == heads
    assert sp_heads == heads // 2  # the rings of a rank hold its heads: the run was sharded
    diff = _max_diff(got, want.latents)
    assert diff <= TOL, f"max abs diff {diff:.3g}"
    print(f"LiveAvatar generate, SP over 2: latents max abs diff {diff:.3g}")
