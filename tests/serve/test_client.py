"""End to end over WebRTC, with real processes: `avatarstream serve` (tiny-random) and the
`avatarstream client` command (aiortc), as a script would use them: the client's JSON, its
recording, interruption latency, key ownership, and a short load test with several sessions."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import av
import numpy as np
import pytest

from avatarstream.bench.inputs import face_image, speechlike, write_png, write_wav
from avatarstream.serve.client import ServerProcess, run_client

TEXT = "Hello there. I am a live avatar, and this is a short test of speaking over WebRTC."


@pytest.fixture(scope="module")
def files(tmp_path_factory):  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("client")
    return {"png": write_png(d / "ref.png", face_image(96)),
            # 0.6 s of silence first, as a file or a microphone often starts
            "wav": write_wav(d / "speech.wav", np.concatenate([np.zeros(9600, np.float32), speechlike(4.0)])),
            "dir": d}


@pytest.fixture(scope="module")
def server(files):  # type: ignore[no-untyped-def]
    with ServerProcess(files["dir"] / "data", args=("--max-sessions", "3")) as s:
        yield s


def client(server, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
    return subprocess.run([sys.executable, "-m", "avatarstream.cli", "client", "--server",
                           server.url, *args], capture_output=True, text=True, timeout=timeout)


def test_client_speaks_text_and_records_it(server, files):
    out = files["dir"] / "text.mp4"
    r = client(server, "--avatar", str(files["png"]), "--text", TEXT, "--token", "key-a",
               "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["frames"] > 100 and 23 < res["fps"] < 27, res
    assert res["ttff_s"] is not None and res["ttff_s"] > 0
    assert abs(res["av_offset_ms"]) <= 40, res
    files["avatar_id"] = res["avatar_id"]
    # The recording holds what arrived: every frame, and the speech in its audio.
    with av.open(str(out)) as c:
        frames = sum(1 for _ in c.decode(video=0))
    with av.open(str(out)) as c:
        audio = np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(audio=0)])
    assert abs(frames - res["frames"]) <= 2
    assert np.abs(audio).max() > 0.05 and np.abs(audio[: 2000]).max() < 0.01  # idle, then speech
    print(f"\nclient text: ttff {res['ttff_s']} s, fps {res['fps']}, av offset "
          f"{res['av_offset_ms']} ms (decoded {res['av_offset_decoded_ms']} ms)")


def test_client_streams_audio_and_interrupts_within_one_chunk(server, files):
    if "avatar_id" not in files:
        pytest.skip("needs the avatar of the text test")
    out = files["dir"] / "audio.mp4"
    r = client(server, "--avatar-id", files["avatar_id"], "--audio", str(files["wav"]),
               "--interrupt-after", "2.1", "--token", "key-a", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    chunk_s = 4 * 4 / 25  # tiny-random: 4 latent frames per chunk
    # Speech stops within one chunk of the media position at the interrupt.
    assert 0 <= res["interrupt_media_s"] <= chunk_s + 0.04, res
    assert res["interrupt_latency_s"] is not None
    # ttff_voice_s counts from the first 40 ms packet the server takes as speech (RMS over its
    # pause threshold), after the silence: sent that much after the first packet
    from avatarstream.media.audio import read_all
    from avatarstream.live.session import LiveSessionConfig

    x = read_all(files["wav"]).astype(np.float64)
    rms = [np.sqrt(np.mean(x[i:i + 640] ** 2)) for i in range(0, x.size, 640)]
    voice_s = 0.04 * next(i for i, r in enumerate(rms) if r >= LiveSessionConfig.silence_rms)
    assert voice_s >= 0.6
    assert res["ttff_s"] - res["ttff_voice_s"] == pytest.approx(voice_s, abs=0.03), (voice_s, res)
    print(f"\nclient audio: ttff {res['ttff_s']} s (from the voice {res['ttff_voice_s']} s), interrupt {res['interrupt_media_s']} s of media, "
          f"{res['interrupt_latency_s']} s wall (as heard)")


def test_client_cannot_use_another_keys_avatar(server, files):
    if "avatar_id" not in files:
        pytest.skip("needs the avatar of the text test")
    r = client(server, "--avatar-id", files["avatar_id"], "--text", "hi", "--token", "key-b",
               "--out", str(files["dir"] / "x.mp4"), "--json", timeout=60)
    assert r.returncode == 2 and "no such avatar" in r.stderr and "Traceback" not in r.stderr


def test_load_several_sessions_and_admission(server, files):
    """Three concurrent sessions (the server's --max-sessions) all play in real time; a fourth is
    refused with a clear message while they run."""

    async def fourth() -> tuple[int, str]:
        import aiohttp

        await asyncio.sleep(2.0)
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer key-a"}) as http:
            async with http.post(server.url + "/v1/sessions",
                                 json={"avatar_id": files["avatar_id"]}) as r:
                return r.status, (await r.json())["error"]

    async def main():  # type: ignore[no-untyped-def]
        runs = [run_client(server.url, api_key="key-a", avatar_id=files["avatar_id"],
                           audio=speechlike(3.0, seed=i), timeout=90) for i in range(3)]
        return await asyncio.gather(*runs, fourth())

    if "avatar_id" not in files:
        pytest.skip("needs the avatar of the text test")
    *results, (status, message) = asyncio.run(main())
    assert status == 503 and "capacity" in message
    for summary, rec in results:
        assert summary["frames"] > 75 and 23 < summary["fps"] < 27, summary
        assert abs(summary["av_offset_ms"]) <= 40, summary
        assert summary["ttff_s"] is not None
    print("\nload: " + ", ".join(f"ttff {s['ttff_s']} s / {s['fps']} fps" for s, _ in results))
