"""Input videos with known answers for the curation tests (tests/data/test_curate.py).

Two files a user might bring, built from our synthetic clips (data/ renderer, their own speech)
and from scikit-image's astronaut photograph (Eileen Collins, NASA, public domain) moved by a
virtual camera (pan, zoom, roll), spliced with hard cuts:

- `studio.mkv`: 320x240, 25 fps, lossy H.264 with 16 kHz mono PCM;
- `phone.mp4`: 320x240, 30 fps, lossy H.264 with 48 kHz stereo AAC (normalisation is exercised).

`SEGMENTS` lists, per file, each shot's content and the verdict curation must reach; `cut_frames`
gives the cuts in 25 fps frames of the normalised video.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
from PIL import Image, ImageFilter

from avatarstream.data.clip import Clip, ClipSpec

W, H = 320, 240
SECONDS = 2.0
SYNTH_VOICE = "espeak:en+m3"


@dataclass(frozen=True)
class Segment:
    """One shot: `kind` (synth: identity; astro: a camera move), its verdict and person label."""

    kind: str
    verdict: str  # "kept" or the expected rejection reason
    person: str  # who is in it ("" for a shot expected to have no kept identity)
    identity: int = 0
    scene: int = 0
    seed: int = 0
    move: str = ""
    audio: str = "speech"  # speech | silent | late (shifted 300 ms)


SEGMENTS = {
    "studio.mkv": [
        Segment("synth", "kept", "A", identity=1, scene=11, seed=3),
        Segment("astro", "kept", "astro", move="pan"),
        Segment("synth", "kept", "B", identity=5, scene=12, seed=4),
        Segment("synth", "av_offset", "", identity=1, scene=11, seed=5, audio="late"),
        Segment("astro", "no_speech", "", move="zoom_in", audio="silent"),
    ],
    "phone.mp4": [
        Segment("astro", "kept", "astro", move="zoom_out"),
        Segment("synth", "kept", "A", identity=1, scene=13, seed=6),
        Segment("astro", "face_too_small", "", move="far"),
        Segment("astro", "blur", "", move="blur"),
        Segment("synth", "duplicate", "A", identity=1, scene=11, seed=3),  # studio.mkv's first shot again
        Segment("astro", "extreme_pose", "", move="roll"),
    ],
}
FPS_OF = {"studio.mkv": 25, "phone.mp4": 30}


def fit(frame: np.ndarray) -> np.ndarray:
    """A square frame scaled to 240 px and centred on a 320 x 240 canvas of its border colour."""
    sq = np.asarray(Image.fromarray(frame).resize((H, H), Image.Resampling.BILINEAR))
    out = np.empty((H, W, 3), np.uint8)
    out[:] = sq[0, 0]
    out[:, (W - H) // 2:(W + H) // 2] = sq
    return out


def camera(img: np.ndarray, move: str, n: int) -> np.ndarray:
    """n frames [n, 240, 320, 3] of the photo seen by a moving camera (window centre, width)."""
    a = np.linspace(0, 1, n)
    cx, cy, w = {"pan": (200 + 60 * a, 150 + 0 * a, 320 + 0 * a), "zoom_in": (222 + 0 * a, 140 + 0 * a, 360 - 60 * a),
                 "zoom_out": (230 + 0 * a, 130 + 0 * a, 270 + 50 * a), "far": (230 + 0 * a, 140 + 0 * a, 620 + 0 * a),
                 "blur": (222 + 10 * a, 140 + 0 * a, 330 + 0 * a), "roll": (222 + 0 * a, 130 + 0 * a, 260 + 0 * a)}[move]
    pic = Image.fromarray(img)
    if move == "blur":
        pic = pic.filter(ImageFilter.GaussianBlur(3))
    frames = []
    for i in range(n):
        h = w[i] * H / W
        box = (cx[i] - w[i] / 2, cy[i] - h / 2, cx[i] + w[i] / 2, cy[i] + h / 2)
        f = pic.transform((W, H), Image.Transform.EXTENT, box, resample=Image.Resampling.BILINEAR)
        if move == "roll":
            f = f.rotate(40, resample=Image.Resampling.BILINEAR, center=(W / 2, H / 2))
        frames.append(np.asarray(f))
    return np.stack(frames)


def segment_media(seg: Segment, astro: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(frames [50, 240, 320, 3] uint8 at 25 fps, audio [32000] float32 at 16 kHz) of one shot."""
    n = int(SECONDS * 25)
    if seg.kind == "synth":
        clip = Clip(ClipSpec(identity=seg.identity, scene=seg.scene, voice=SYNTH_VOICE, seed=seg.seed,
                             seconds=SECONDS, size=256))
        frames, audio = np.stack([fit(f) for f in clip.frames()]), clip.audio
    else:  # speech of a synthetic clip (its pictures are not rendered) over the photo
        voice = Clip(ClipSpec(identity=9, scene=0, voice=SYNTH_VOICE, seed=100 + seed, seconds=SECONDS))
        frames, audio = camera(astro, seg.move, n), voice.audio
    if seg.audio == "silent":
        audio = 0.0003 * np.random.default_rng(seed).standard_normal(len(audio)).astype(np.float32)
    elif seg.audio == "late":
        audio = np.concatenate([np.zeros(4800, np.float32), audio])[: len(audio)]  # 300 ms late
    return frames, audio.astype(np.float32)


def to_fps(frames: np.ndarray, fps: int) -> np.ndarray:
    """25 fps frames -> `fps` frames (nearest in time)."""
    n = int(round(len(frames) * fps / 25))
    return frames[np.minimum(np.round(np.arange(n) * 25 / fps).astype(int), len(frames) - 1)]


def write_video(path: Path, frames: np.ndarray, fps: int, audio: np.ndarray, rate: int, layout: str) -> None:
    """Lossy H.264 (yuv420p, crf 18) with AAC (mp4) or PCM (mkv) audio, as a user's file would be."""
    with av.open(str(path), "w") as c:
        v = c.add_stream("libx264", rate=fps)
        v.width, v.height, v.pix_fmt = W, H, "yuv420p"
        v.options = {"crf": "18"}
        v.thread_count = 1
        a = c.add_stream("aac" if path.suffix == ".mp4" else "pcm_s16le", rate=rate, layout=layout)
        for f in frames:
            for p in v.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                c.mux(p)
        for p in v.encode():
            c.mux(p)
        chans = 2 if layout == "stereo" else 1
        pcm = np.clip(np.round(audio * 32767), -32768, 32767).astype(np.int16)
        inter = np.repeat(pcm, chans)[None]  # packed s16: [1, n * channels]
        step = 1024
        for s in range(0, len(pcm), step):
            fr = av.AudioFrame.from_ndarray(np.ascontiguousarray(inter[:, s * chans:(s + step) * chans]),
                                            format="s16", layout=layout)
            fr.sample_rate = rate
            fr.pts = s
            for p in a.encode(fr):
                c.mux(p)
        for p in a.encode():
            c.mux(p)


def resample(audio: np.ndarray, rate: int) -> np.ndarray:
    if rate == 16000:
        return audio
    t = np.arange(int(len(audio) * rate / 16000)) * 16000 / rate
    return np.interp(t, np.arange(len(audio)), audio).astype(np.float32)


def build_inputs(folder: Path, astro: np.ndarray) -> dict[str, Path]:
    """Write both files into `folder`; returns {name: path}."""
    out = {}
    for name, segs in SEGMENTS.items():
        media = [segment_media(s, astro, i) for i, s in enumerate(segs)]
        frames = np.concatenate([m[0] for m in media])
        audio = np.concatenate([m[1] for m in media])
        fps = FPS_OF[name]
        rate, layout = (48000, "stereo") if name == "phone.mp4" else (16000, "mono")
        write_video(folder / name, to_fps(frames, fps), fps, resample(audio, rate), rate, layout)
        out[name] = folder / name
    return out


def cut_frames(name: str) -> list[int]:
    """The cuts of a file in frames of the normalised 25 fps video (shots are 2 s each)."""
    return [int(SECONDS * 25) * k for k in range(1, len(SEGMENTS[name]))]
