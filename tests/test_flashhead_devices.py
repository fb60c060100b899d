"""SoulX-FlashHead behind the other commands and devices: `bench realtime` and `serve` run a tiny
official-layout folder (`write_official_folder`) on the CPU; `--device cuda` without CUDA is
generate's one clear error in every command; and a GPU without the memory the folder needs is
refused before a tensor is read (torch.cuda mocked: the check is our own logic)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_cli

from avatarstream.errors import ConfigError
from avatarstream.weights import flashhead_folder as ff
from avatarstream.weights.flashhead_folder import parse_name, write_official_folder

pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:  # noqa: ANN001
    return write_official_folder(tmp_path_factory.mktemp("fh") / "SoulX-FlashHead-1_3B")


@pytest.mark.slow
def test_bench_realtime_runs_a_flashhead_folder(media, folder: Path) -> None:
    r = run_cli("bench", "realtime", "--model", f"flashhead-pro:{folder}", "--reference", str(media["png"]),
                "--audio", str(media["wav_3s"]), "--threads", "1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["device"] == "cpu" and out["strategy"] == "handoff" and out["resolution"] == 64
    assert out["frames"] == 75 and out["rtf"] > 0


def test_serve_starts_on_a_flashhead_folder(folder: Path, tmp_path: Path) -> None:
    """The server's start-up calibration loads the folder and runs its chunks; then it answers."""
    from avatarstream.serve.client import ServerProcess

    with ServerProcess(tmp_path / "data", model=f"flashhead-pro:{folder}", timeout=120) as server:
        assert server.info["model"] == f"flashhead-pro:{folder}"
        cap = server.info["capacity"]  # measured by running the model's chunks at start-up
        assert cap["measured"] and cap["step_per_session_s"] > 0 and cap["max_sessions"] >= 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without CUDA")
@pytest.mark.parametrize("cmd", [("serve", "--data-dir"), ("bench", "realtime", "--audio"),
                                 ("eval", "benchmark", "--split", "heldout-voice", "--out")])
def test_device_cuda_without_cuda_is_one_clear_error(cmd: tuple[str, ...], folder: Path, tmp_path: Path) -> None:
    r = run_cli(*cmd, str(tmp_path / "o"), "--model", f"flashhead-pro:{folder}", "--device", "cuda")
    assert r.returncode != 0 and "--device cuda: no CUDA GPU" in r.stderr and "Traceback" not in r.stderr


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 << 30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")


def test_a_gpu_without_the_memory_is_refused_before_reading(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    _fake_gpu(monkeypatch, free=50_000_000)
    read: list[Path] = []
    monkeypatch.setattr(ff, "read_state", lambda path: read.append(path))
    monkeypatch.setattr(ff, "load_wav2vec2_folder", lambda path: read.append(path))
    name = f"flashhead-pro:{folder}"
    with pytest.raises(ConfigError, match=r"needs about [0-9.]+ GB of GPU memory \(bf16\), cuda has 50\.0 MB free"):
        ff.load_flashhead(parse_name(name), name, device="cuda", bf16=True)
    assert read == []


def test_enough_gpu_memory_or_the_cpu_passes_the_check(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    fh = parse_name(f"flashhead-pro:{folder}")
    ff.check_gpu_memory(fh, "cpu", bf16=False)  # no GPU asked for: nothing is checked
    _fake_gpu(monkeypatch, free=80 << 30)
    ff.check_gpu_memory(fh, "cuda", bf16=True)
    ff.check_gpu_memory(fh, "cuda", bf16=False)
    # the tiny folder: bf16 about 1.17 GB (mostly the 1 GiB CUDA reserve), fp32 about 1.27 GB
    _fake_gpu(monkeypatch, free=1_220_000_000)
    ff.check_gpu_memory(fh, "cuda", bf16=True)
    with pytest.raises(ConfigError, match=r"\(fp32\), cuda has 1\.2 GB free"):
        ff.check_gpu_memory(fh, "cuda", bf16=False)
