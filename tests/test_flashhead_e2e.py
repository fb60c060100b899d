"""SoulX-FlashHead Pro behind our engine, end to end on a tiny random folder in the official
layout (`write_official_folder`): `generate --model flashhead-pro:DIR` -> an MP4 that decodes,
clear errors for a broken download and a missing GPU, and a live session through live/ (the
same chunk loop and stages) producing talk frames."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_cli
from live_helpers import speak_once
from test_cli import probe

from avatarstream.errors import InputError
from avatarstream.weights.flashhead_folder import write_official_folder

# bf16 where the CPU is fast at it (AVX512-bf16): the DiT's RMSNorm then takes fp32 input with bf16
# weights outside autocast's list, which torch computes unfused and says so
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:  # noqa: ANN001
    return write_official_folder(tmp_path_factory.mktemp("fh") / "SoulX-FlashHead-1_3B")


def test_official_layout_is_what_was_written(folder: Path) -> None:
    for rel in ("Model_Pro/config.json", "Model_Pro/diffusion_pytorch_model.safetensors",
                "VAE_Wan/Wan2.1_VAE.pth", "wav2vec2-base-960h/config.json",
                "wav2vec2-base-960h/model.safetensors"):
        assert (folder / rel).is_file(), rel


def test_generate_writes_a_decodable_mp4(media, folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "fh.mp4"
    r = run_cli("generate", "--model", f"flashhead-pro:{folder}", "--reference", str(media["png"]),
                "--audio", str(media["wav_3s"]), "--out", str(out), "--json", "--no-progress",
                "--threads", "1")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    info = probe(out)
    assert info["vcodec"] == "h264" and info["width"] == 64
    assert info["frames"] == summary["frames"] == 75  # 3 s: 3 chunks of 28 frames, trimmed
    assert summary["strategy"] == "handoff" and summary["chunks"] == 3


def test_broken_download_and_missing_gpu_are_one_clear_error(media, folder: Path, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    (broken / "VAE_Wan" / "Wan2.1_VAE.pth").unlink()
    args = ("--reference", str(media["png"]), "--audio", str(media["wav_3s"]),
            "--out", str(tmp_path / "x.mp4"), "--no-progress")
    r = run_cli("generate", "--model", f"flashhead-pro:{broken}", *args)
    assert r.returncode != 0 and "Wan2.1_VAE.pth is missing" in r.stderr and "Traceback" not in r.stderr
    if not torch.cuda.is_available():
        r = run_cli("generate", "--model", f"flashhead-pro:{folder}", "--device", "cuda", *args)
        assert r.returncode != 0 and "no CUDA GPU" in r.stderr and "Traceback" not in r.stderr


def test_a_wrong_variant_folder_is_an_input_error(folder: Path) -> None:
    from avatarstream.registry import model_spec_for

    with pytest.raises(InputError, match="Model_Lite"):
        model_spec_for(f"flashhead-lite:{folder}")


def test_live_session_speaks_through_the_same_stages(folder: Path, tmp_path: Path) -> None:
    """A live session of a FlashHead avatar: its reference prepared once and kept on disk (as the
    server's avatar store does), then speech through the scheduler and the same stages."""
    from avatarstream.live.prepared import load_prepared, prepare_reference, save_prepared
    from avatarstream.live.session import LiveSession, LiveSessionConfig
    from avatarstream.registry import load_model

    models = load_model(f"flashhead-pro:{folder}")
    c = models.config
    ref = torch.randint(0, 255, (1, 3, c.hr_size, c.hr_size), dtype=torch.uint8)
    save_prepared(prepare_reference(models, ref), tmp_path / "ref.safetensors")
    prepared = load_prepared(tmp_path / "ref.safetensors")
    session = LiveSession(models, ref, prepared=prepared,
                          config=LiveSessionConfig(lead_s=0.2, idle_timeout_s=10.0))
    t = np.arange(int(2.5 * c.sample_rate)) / c.sample_rate
    video = [it.pts for it in speak_once(session, (0.5 * np.sin(2 * np.pi * 220 * t)).astype(np.float32),
                                         wait_s=20, timeout_s=40)]
    assert session.error is None, session.error
    kinds = [e["type"] for e in session.events]
    assert "speech_started" in kinds and "speech_ended" in kinds
    assert session.scheduler.stats.chunks >= 3  # 2.5 s of speech: 28 frames a chunk
    assert np.allclose(np.diff(video), 1 / c.fps)  # idle and talk frames on one clock
    assert video[-1] >= 2.5


def _run(models, seconds: float) -> tuple[object, list]:  # noqa: ANN001
    from avatarstream.engine.pipeline import Pipeline
    from avatarstream.eval.benchmark import CollectSink

    g = torch.Generator().manual_seed(0)
    c = models.config
    ref = (torch.rand(1, 3, c.hr_size, c.hr_size, generator=g) * 255).to(torch.uint8)
    wave = 0.1 * torch.randn(int(seconds * c.sample_rate), generator=g)
    sink = CollectSink()
    return Pipeline(models).run(ref, iter(wave.split(3200)), [sink]), sink.frames


def test_rolling_state_is_constant_in_duration(folder: Path) -> None:
    """y, the colour reference, the 8 s audio window and the hand-off latents: the same bytes
    after 6 s and after 12 s."""
    from avatarstream.registry import load_model

    models = load_model(f"flashhead-pro:{folder}")
    short, _ = _run(models, 6.0)
    long, frames = _run(models, 12.0)
    assert long.frames == len(frames) == 300 and long.chunks == 11
    assert long.rolling_state_bytes == short.rolling_state_bytes > 128000 * 4


def test_lite_runs_with_its_own_latent_stride(tmp_path: Path) -> None:
    """Lite: LTX latents of 8 frames, 5-latent chunks of 24 new frames; the chunk loop plans with
    `PipelineConfig.latent_stride`."""
    from avatarstream.registry import load_model

    root = write_official_folder(tmp_path / "fh", "lite")
    models = load_model(f"flashhead-lite:{root}")
    assert (models.config.chunk, models.config.latent_stride, models.config.audio_window) == (5, 8, 4)
    summary, frames = _run(models, 3.0)
    assert summary.frames == len(frames) == 75 and summary.chunks == 4  # 24 new frames a chunk
    assert frames[0].shape == (64, 64, 3) and np.stack(frames).std(axis=0).mean() > 0


def test_bf16_loads_the_dit_in_bf16_and_runs(folder: Path) -> None:
    """What a GPU gets by default: the DiT's weights cast while assigned, its forward autocast."""
    from avatarstream.registry import load_model

    models = load_model(f"flashhead-pro:{folder}", bf16=True)
    assert {p.dtype for p in models.dit.model.parameters()} == {torch.bfloat16}
    assert models.dit.autocast_dtype == torch.bfloat16
    summary, frames = _run(models, 1.0)
    assert summary.frames == len(frames) == 25


def test_fp8_flag_quantizes_the_dit_blocks(folder: Path) -> None:
    """`flashhead-pro:DIR,fp8`: the blocks' linears in float8 with a scale per row; it renders."""
    from avatarstream.models.fp8 import Float8Linear
    from avatarstream.registry import load_model

    models = load_model(f"flashhead-pro:{folder},fp8", bf16=False)
    q = [m for m in models.dit.model.blocks.modules() if isinstance(m, Float8Linear)]
    assert q and {m.weight.dtype for m in q} == {torch.float8_e4m3fn}
    summary, frames = _run(models, 1.0)
    assert summary.frames == len(frames) == 25
