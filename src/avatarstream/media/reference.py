"""Load the reference (the person to animate) from a video or an image into square uint8 frames.

Which frames of a video
-----------------------
A video gives its *first* `max_frames` decodable frames, consecutive at the source frame rate,
trimmed to the longest 1 + 4k prefix (F = 1 + 4·((n − 1) // 4)) so the causal video VAE (which
packs 1 + 4k frames into 1 + k latent frames) uses all of them. Consecutive frames, rather than
frames spread over the whole video, keep the clip the VAE encodes temporally coherent (the
motion it was trained on), and only the beginning of a long video is decoded. An image gives one
frame.

Geometry
--------
Each frame is center-cropped to a square (the shorter side) and resized to `size` x `size` with
antialiased bilinear filtering (area-like when shrinking). Rotation metadata (phone videos) is
applied first, so the person stands upright.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
import torch
import torch.nn.functional as F

from avatarstream.errors import InputError

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}


@dataclass(frozen=True)
class Reference:
    """frames: [F, 3, size, size] uint8 RGB; fps of the source video (None for an image);
    source_size: (width, height) of the source before cropping; is_image: a still picture."""

    frames: torch.Tensor
    fps: float | None
    source_size: tuple[int, int]
    is_image: bool


def square_resize(rgb: np.ndarray, size: int) -> torch.Tensor:
    """[H, W, 3] uint8 -> [3, size, size] uint8: center crop to a square, then resize."""
    h, w = rgb.shape[:2]
    s = min(h, w)
    top, left = (h - s) // 2, (w - s) // 2
    x = torch.from_numpy(np.ascontiguousarray(rgb[top:top + s, left:left + s]))  # [s, s, 3]
    x = x.permute(2, 0, 1)  # [3, s, s]
    if s == size:
        return x.contiguous()
    y = F.interpolate(x[None].float(), size=(size, size), mode="bilinear", align_corners=False,
                      antialias=True)  # [1, 3, size, size]
    return y[0].round().clamp(0, 255).to(torch.uint8)


def _upright(frame: av.VideoFrame) -> np.ndarray:
    """[H, W, 3] uint8 RGB with the stream's display rotation applied."""
    rgb = frame.to_ndarray(format="rgb24")
    rotation = int(round(getattr(frame, "rotation", 0) or 0)) % 360
    if rotation in (90, 180, 270):
        rgb = np.rot90(rgb, k=rotation // 90)  # rotation is counter-clockwise in degrees
    return rgb


def usable_frame_count(n: int) -> int:
    """Largest 1 + 4k not above n (n >= 1)."""
    return 1 + 4 * ((n - 1) // 4)


def load_reference(path: str | Path, *, size: int, max_frames: int, what: str = "reference") -> Reference:
    """Read a reference video (mp4/mov/webm/mkv) or image (png/jpg/webp) into square frames.

    Raises InputError naming the file (as `what`: "reference", "scene image") when it is
    missing, empty, unreadable, or has no decodable video frame.
    """
    if size < 1 or max_frames < 1:
        raise ValueError(f"size and max_frames must be positive (got {size}, {max_frames})")
    p = Path(path)
    if not p.exists():
        raise InputError(f"{what} {p} not found; give a video (mp4/mov/webm/mkv) or an image "
                         "(png/jpg/webp) of the person")
    if p.is_dir():
        raise InputError(f"{what} {p} is a folder; give a video or image file")
    if p.stat().st_size == 0:
        raise InputError(f"{what} {p} is empty (0 bytes)")
    try:
        container = av.open(str(p))
    except (av.FFmpegError, OSError, ValueError) as e:
        raise InputError(f"{what} {p} is not a readable video or image ({_reason(e)})") from e
    with container:
        if not container.streams.video:
            raise InputError(f"{what} {p} has no video or image in it")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        fmt = container.format.name
        is_image = p.suffix.lower() in IMAGE_SUFFIXES or fmt == "image2" or fmt.endswith("_pipe")
        fps = None if is_image or not stream.average_rate else float(stream.average_rate)
        want = 1 if is_image else max_frames
        frames: list[torch.Tensor] = []
        source_size = (0, 0)
        try:
            for frame in container.decode(stream):
                rgb = _upright(frame)
                source_size = (rgb.shape[1], rgb.shape[0])
                frames.append(square_resize(rgb, size))
                if len(frames) >= want:
                    break
        except (av.FFmpegError, OSError, ValueError) as e:
            if not frames:
                raise InputError(f"{what} {p} could not be decoded ({_reason(e)}); it is "
                                 "corrupt or not a video/image") from e
            # a damaged tail: keep the frames decoded before it
    if not frames:
        raise InputError(f"{what} {p} has no decodable video frame")
    frames = frames[:usable_frame_count(len(frames))]
    return Reference(frames=torch.stack(frames), fps=fps, source_size=source_size,
                     is_image=is_image)  # [F, 3, size, size]


def _reason(e: BaseException) -> str:
    """The useful part of a PyAV error (no errno, no repeated file name)."""
    msg = getattr(e, "strerror", None) or str(e)
    return str(msg).rstrip(".")
