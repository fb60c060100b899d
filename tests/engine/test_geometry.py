"""Non-square (H, W) video through the engine: the config's geometry and its checks, reference
loading (centre crop to the aspect, then resize), the Wan VAE's streamed decode, our own tiny model,
and a tiny SoulX-FlashHead folder in the official layout rendered by `generate --size WxH` and by a
live session, with frames of exactly that size."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from conftest import run_cli
from live_helpers import speak_once
from serve.helpers import _finished_render

from avatarstream.engine.config import PipelineConfig, parse_size
from avatarstream.errors import ConfigError, InputError
from avatarstream.media.image import write_png
from avatarstream.media.reference import crop_window, fit_resize, load_reference
from avatarstream.media.synthetic import face_image, speechlike, write_wav
from avatarstream.weights.flashhead_folder import write_official_folder

# bf16 where the CPU is fast at it: see tests/test_flashhead_e2e.py
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")]
H, W = 32, 48  # FlashHead Pro's tiny folder: sides multiples of 16 (8x VAE, 2x2 patch)


def _config(**kw) -> PipelineConfig:  # noqa: ANN003
    base = dict(lr_size=128, hr_size=256, latent_channels=16, motion_dim=16, chunk=8, ref_frames=4, steps=4)
    return PipelineConfig(**{**base, **kw})


def test_square_configs_keep_their_geometry() -> None:
    c = _config()
    assert (c.out_hw, c.lr_hw, c.latent_hw, c.pixel_multiple) == ((256, 256), (128, 128), (16, 16), 32)


def test_non_square_geometry_scales_to_the_dit_and_its_latents() -> None:
    c = _config().with_size(288, 512)
    assert (c.out_hw, c.lr_hw, c.latent_hw) == ((288, 512), (144, 256), (18, 32))
    pro = _config(lr_size=512, hr_size=512).with_size(400, 720)  # LiveAvatar's 720x400: 90x50 latents
    assert pro.latent_hw == (50, 90) and pro.pixel_multiple == 16


@pytest.mark.parametrize(("kw", "size", "multiple"), [
    ({}, (48, 64), 32),  # ours: 8x VAE, 2x2 patch, generated at half size
    ({"lr_size": 512, "hr_size": 512}, (40, 64), 16),  # FlashHead Pro
    ({"lr_size": 512, "hr_size": 512, "spatial_stride": 32, "patch_size": 1}, (48, 64), 32),  # Lite
])
def test_bad_geometry_is_one_error_naming_the_multiple(kw: dict, size: tuple[int, int], multiple: int) -> None:
    with pytest.raises(ConfigError, match=f"multiples of {multiple} pixels"):
        _config(**kw).with_size(*size)
    with pytest.raises(ConfigError, match="height and width together"):
        _config(height=64)


def test_parse_size_reads_width_first() -> None:
    assert parse_size("512x288") == (288, 512) == parse_size("512*288")
    assert parse_size("64") == (64, 64)
    for bad in ("512x", "ax3", "0x16", "1x2x3"):
        with pytest.raises(ConfigError, match="WIDTHxHEIGHT"):
            parse_size(bad)


def test_reference_is_centre_cropped_to_the_aspect() -> None:
    rgb = np.zeros((50, 100, 3), np.uint8)
    rgb[..., 0] = np.arange(100, dtype=np.uint8)[None]  # column index in red
    assert crop_window(50, 100, 50, 25) == (0, 37, 50, 25)  # landscape -> portrait: cut the sides
    assert crop_window(100, 50, 25, 50) == (37, 0, 25, 50)  # portrait -> landscape: top and bottom
    out = fit_resize(rgb, 50, 25)  # the crop at its own size: no resampling
    assert out.shape == (3, 50, 25) and torch.equal(out[0, 0], torch.arange(37, 62, dtype=torch.uint8))
    small = fit_resize(rgb, 20, 10)  # resized after the crop: red stays around the middle columns
    assert small.shape == (3, 20, 10) and 37 <= int(small[0].min()) and int(small[0].max()) <= 62


def test_load_reference_gives_frames_of_the_video_size(tmp_path: Path) -> None:
    png = write_png(tmp_path / "wide.png", np.ascontiguousarray(face_image(96)[16:80]))  # 96x64
    ref = load_reference(png, size=(H, W), max_frames=1)
    assert ref.frames.shape == (1, 3, H, W) and ref.source_size == (96, 64)
    assert load_reference(png, size=40, max_frames=1).frames.shape == (1, 3, 40, 40)


def test_wan_streamed_decode_equals_whole_on_non_square_latents() -> None:
    """The conv caches of the streamed decode hold (h, w) planes: exact at 4x6 latents."""
    from avatarstream.models.wan.vae import WanVAE, WanVAEConfig

    torch.manual_seed(0)
    vae = WanVAE(WanVAEConfig.tiny()).eval()
    z = torch.randn(1, vae.cfg.z_dim, 3, 4, 6)  # [1, z, T, h, w]
    with torch.no_grad():
        whole = vae.decode(z)  # [1, 3, 9, 32, 48]
        cache = vae.new_cache()
        streamed = torch.cat([vae.decode_step(z[:, :, :1], cache), vae.decode_step(z[:, :, 1:], cache)], 2)
    assert whole.shape[-2:] == (32, 48) and torch.equal(streamed, whole)  # tolerance: bit for bit


def _run(models, frames: torch.Tensor, seconds: float) -> list[np.ndarray]:  # noqa: ANN001
    from avatarstream.engine.pipeline import Pipeline
    from avatarstream.eval.benchmark import CollectSink

    wave = torch.from_numpy(speechlike(seconds)).float()
    sink = CollectSink()
    Pipeline(models).run(frames, iter(wave.split(3200)), [sink])
    return sink.frames


def test_our_tiny_model_renders_non_square() -> None:
    """Reference K/V at both resolutions, DiT and refiner token grids, the streamed decode."""
    from avatarstream.registry import load_model

    models = load_model("tiny-random")
    models = dataclasses.replace(models, config=models.config.with_size(64, 96))
    frames = fit_resize(face_image(96), 64, 96)[None]  # [1, 3, 64, 96]
    out = _run(models, frames, 0.6)
    assert len(out) == 15 and {f.shape for f in out} == {(64, 96, 3)}
    with pytest.raises(InputError, match="48x48 pixels .* renders 96x64"):
        _run(models, fit_resize(face_image(96), 48, 48)[None], 0.2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:  # noqa: ANN001
    return write_official_folder(tmp_path_factory.mktemp("fh") / "SoulX-FlashHead-1_3B")


def test_flashhead_generate_writes_the_asked_size(folder: Path, tmp_path: Path) -> None:
    png = write_png(tmp_path / "portrait.png", np.ascontiguousarray(face_image(96)[:, 20:76]))  # 56x96
    wav = write_wav(tmp_path / "speech.wav", speechlike(1.0))
    out = tmp_path / "fh.mp4"
    r = run_cli("generate", "--model", f"flashhead-pro:{folder}", "--reference", str(png), "--audio", str(wav),
                "--out", str(out), "--hls", str(tmp_path / "hls"), "--size", f"{W}x{H}", "--json", "--no-progress",
                "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["frames"] == 25
    for path in (out, tmp_path / "hls" / "index.m3u8"):  # the fMP4 file and the HLS stream
        with av.open(str(path)) as c:
            v = c.streams.video[0]
            assert (v.codec_context.width, v.codec_context.height) == (W, H)
            assert {f.to_ndarray(format="rgb24").shape for f in c.decode(video=0)} == {(H, W, 3)}

    bad = run_cli("generate", "--model", f"flashhead-pro:{folder}", "--reference", str(png), "--audio", str(wav),
                  "--out", str(tmp_path / "bad.mp4"), "--size", "40x40", "--no-progress")
    assert bad.returncode != 0 and "multiples of 16 pixels" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "bad.mp4").exists()


def test_flashhead_folder_geometry_from_its_sidecar(folder: Path, tmp_path: Path) -> None:
    from avatarstream.weights.flashhead_folder import SIDECAR, FlashHeadFolder, flashhead_pipeline

    root = tmp_path / "fh"
    shutil.copytree(folder / "Model_Pro", root / "Model_Pro")
    extra = json.loads((folder / SIDECAR).read_text())
    (root / SIDECAR).write_text(json.dumps({**extra, "height": H, "width": W}))
    fh = FlashHeadFolder(root, "pro", folder / "wav2vec2-base-960h")
    c = flashhead_pipeline(fh)
    assert (c.out_hw, c.latent_hw, c.pixel_multiple) == ((H, W), (H // 8, W // 8), 16)
    (root / SIDECAR).write_text(json.dumps({**extra, "height": 40, "width": W}))
    with pytest.raises(ConfigError, match=f"{SIDECAR}: .*multiples of 16 pixels"):
        flashhead_pipeline(fh)


def test_flashhead_live_session_publishes_non_square_frames(folder: Path, tmp_path: Path) -> None:
    """A non-square avatar prepared once and kept on disk, then idle and talk frames of its size;
    an avatar prepared for another size is refused with one clear error."""
    from avatarstream.live.prepared import load_prepared, prepare_reference, save_prepared
    from avatarstream.live.session import LiveSession, LiveSessionConfig
    from avatarstream.registry import load_model

    base = load_model(f"flashhead-pro:{folder}")
    models = dataclasses.replace(base, config=base.config.with_size(H, W))
    ref = fit_resize(face_image(96), H, W)[None]  # [1, 3, H, W]
    save_prepared(prepare_reference(models, ref), tmp_path / "ref.safetensors")
    prepared = load_prepared(tmp_path / "ref.safetensors")
    assert prepared.dit.y.shape[-2:] == (H // 8, W // 8) and prepared.dit.color.shape[-2:] == (H, W)
    square = prepare_reference(base, fit_resize(face_image(96), 64, 64)[None])
    with pytest.raises(InputError, match="prepared for a 64x64 video .* renders 48x32"):
        LiveSession(models, ref, prepared=square)

    session = LiveSession(models, ref, prepared=prepared, config=LiveSessionConfig(lead_s=0.2, idle_timeout_s=10.0))
    items = speak_once(session, speechlike(1.2), wait_s=20, timeout_s=40)
    video = [it.pts for it in items]
    shapes = {it.data.shape for it in items}
    assert session.error is None, session.error
    assert "speech_ended" in [e["type"] for e in session.events] and session.scheduler.stats.chunks >= 2
    assert shapes == {(H, W, 3)} and video[-1] >= 1.2


def test_server_stores_avatars_and_renders_at_its_size(tmp_path: Path) -> None:
    """`serve --size 96x64` with our tiny model: the avatar store crops uploads to the video's
    aspect, and a render job writes an MP4 of that size (fMP4 sink opened with width, height)."""
    from aiohttp.test_utils import TestClient, TestServer

    from avatarstream.registry import load_model
    from avatarstream.serve.app import ServerConfig, make_app

    models = load_model("tiny-random")
    models = dataclasses.replace(models, config=dataclasses.replace(models.config, steps=1).with_size(64, 96))
    app = make_app(models, ServerConfig(data_dir=tmp_path / "data", max_sessions=1, playout_delay_s=0.3))
    png = write_png(tmp_path / "ref.png", face_image(128)).read_bytes()
    wav = write_wav(tmp_path / "s.wav", speechlike(0.6)).read_bytes()
    auth = {"Authorization": "Bearer k"}

    async def body(client: TestClient) -> None:
        r = await client.post("/v1/avatars", data=png, headers={**auth, "Content-Type": "image/png"})
        avatar = await r.json()
        assert r.status == 201 and avatar["size"] == "96x64", avatar
        job = await _finished_render(client, avatar["id"], wav, headers=auth)
        assert job["state"] == "done", job
        (tmp_path / "r.mp4").write_bytes(await (await client.get(job["output_url"], headers=auth)).read())

    async def main() -> None:
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            await asyncio.wait_for(body(client), timeout=60)

    asyncio.run(main())
    with av.open(str(tmp_path / "r.mp4")) as c:
        assert {f.to_ndarray(format="rgb24").shape for f in c.decode(video=0)} == {(64, 96, 3)}
