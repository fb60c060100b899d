"""Short MP4s through the file sink for the provenance tests: signed or not, marked or not."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np

from avatarstream.media.frames import AudioChunk, VideoChunk
from avatarstream.media.synthetic import speechlike
from avatarstream.provenance.credentials import ContentCredentials
from avatarstream.publish.file import FragmentedMP4Sink

FPS, SR = 25, 16000


def write_clip(path: Path, credentials: ContentCredentials | None = None, *, seconds: int = 1,
               size: int = 64, watermark: bool = False) -> FragmentedMP4Sink:
    """A short fragmented MP4 through the file sink (seeded noise frames, one chunk a second;
    `watermark`: with the invisible watermark embedded)."""
    from avatarstream.provenance.watermark import embed

    rng = np.random.default_rng(0)
    sink = FragmentedMP4Sink(path, atomic=True, credentials=credentials)
    sink.open(size, size, FPS, SR)
    for k in range(seconds):
        frames = rng.integers(0, 255, (FPS, size, size, 3), dtype=np.uint8)
        if watermark:
            frames = embed(frames, k * FPS)
        sink.write_video(VideoChunk(frames=frames, start_frame=k * FPS, fps=FPS))
        sink.write_audio(AudioChunk(samples=speechlike(1.0), start_sample=k * SR, sample_rate=SR))
    sink.close()
    return sink


def decoded(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with av.open(str(path)) as c:
        video = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    with av.open(str(path)) as c:
        audio = np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(audio=0)])
    return video, audio


def top_boxes(path: Path) -> list[str]:
    data, pos, kinds = path.read_bytes(), 0, []
    while pos < len(data):
        size = int.from_bytes(data[pos:pos + 4], "big")
        kinds.append(data[pos + 4:pos + 8].decode())
        pos += size
    return kinds
