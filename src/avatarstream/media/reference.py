"""Load the reference (the person to animate) from a video or an image into uint8 frames of the
video's size (square, or height x width).

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
Each frame is center-cropped to the target's aspect ratio (the largest such window; for a square
target, the shorter side) and resized to the target size with antialiased bilinear filtering
(area-like when shrinking): what users expect of "fit a portrait photo into a 512x288 video",
nothing stretched. Rotation metadata (phone videos) is applied first, so the person stands
upright. The crop is centred, not on the face: the project's face locator (eval/experts.py) is
trained on the synthetic domain only, and a portrait usually has the face near the middle.

Bounded decoding
----------------
No picture over `max_pixels` (`media.image.MAX_PIXELS`, 40 MP) is decoded: an image's size is read
from its header first (`media.image.check_pixels`) and a video's from its stream, and the decoder
itself refuses a larger frame before allocating it (FFmpeg's `max_pixels`). A JPEG above the limit
is decoded at 1/2, 1/4 or 1/8 of its size instead (DCT scaling), then cropped and resized as any
other picture.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
import torch
import torch.nn.functional as F

from avatarstream.errors import InputError
from avatarstream.media.image import MAX_PIXELS, check_pixels, decoder_options, megapixels, too_many_pixels

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}


@dataclass(frozen=True)
class Reference:
    """frames: [F, 3, H, W] uint8 RGB; fps of the source video (None for an image);
    source_size: (width, height) of the source before cropping; is_image: a still picture."""

    frames: torch.Tensor
    fps: float | None
    source_size: tuple[int, int]
    is_image: bool


def crop_window(h: int, w: int, height: int, width: int) -> tuple[int, int, int, int]:
    """(top, left, rows, cols): the largest centred window of an h x w picture with the aspect
    ratio height : width (a square target: the shorter side)."""
    if w * height > h * width:  # the source is wider than the target: cut its sides
        rows, cols = h, max(1, min(w, round(h * width / height)))
    else:  # taller (or the same aspect): cut top and bottom
        rows, cols = max(1, min(h, round(w * height / width))), w
    return (h - rows) // 2, (w - cols) // 2, rows, cols


def fit_resize(rgb: np.ndarray, height: int, width: int) -> torch.Tensor:
    """[H, W, 3] uint8 -> [3, height, width] uint8: center crop to the target's aspect, then resize."""
    top, left, rows, cols = crop_window(rgb.shape[0], rgb.shape[1], height, width)
    x = torch.from_numpy(np.ascontiguousarray(rgb[top:top + rows, left:left + cols]))  # [rows, cols, 3]
    x = x.permute(2, 0, 1)  # [3, rows, cols]
    if (rows, cols) == (height, width):
        return x.contiguous()
    y = F.interpolate(x[None].float(), size=(height, width), mode="bilinear", align_corners=False,
                      antialias=True)  # [1, 3, height, width]
    return y[0].round().clamp(0, 255).to(torch.uint8)


def square_resize(rgb: np.ndarray, size: int) -> torch.Tensor:
    """[H, W, 3] uint8 -> [3, size, size] uint8: center crop to a square, then resize."""
    return fit_resize(rgb, size, size)


def target_size(size: int | tuple[int, int]) -> tuple[int, int]:
    """(height, width) of `size`: one side of a square, or (height, width) itself."""
    hw = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    if min(hw) < 1:
        raise ValueError(f"the frame size must be positive (got {hw[1]}x{hw[0]})")
    return hw


def quarter_turns(frame: av.VideoFrame) -> int:
    """Counter-clockwise quarter turns (0-3) that stand `frame` upright: its display rotation
    (a phone video's display matrix, a JPEG's EXIF orientation) to the nearest 90 degrees."""
    return round(float(frame.rotation or 0) / 90) % 4


def upright(frame: av.VideoFrame, size: tuple[int, int] | None = None,
            interpolation: str | None = None) -> np.ndarray:
    """[H, W, 3] uint8 RGB of `frame` as a viewer sees it (its display rotation applied).

    `size`: (width, height) of the upright picture; the frame is resized to it first by swscale
    (`interpolation`, e.g. "AREA"), in its stored orientation (width and height swapped for a
    quarter turn), then turned.
    """
    k = quarter_turns(frame)
    if size is None:
        rgb = frame.to_ndarray(format="rgb24")
    else:
        w, h = size if k % 2 == 0 else size[::-1]
        rgb = frame.reformat(width=w, height=h, format="rgb24", interpolation=interpolation).to_ndarray()
    return np.ascontiguousarray(np.rot90(rgb, k)) if k else rgb


def usable_frame_count(n: int) -> int:
    """Largest 1 + 4k not above n (n >= 1)."""
    return 1 + 4 * ((n - 1) // 4)


def load_reference(path: str | Path, *, size: int | tuple[int, int], max_frames: int,
                   what: str = "reference", max_pixels: int = MAX_PIXELS) -> Reference:
    """Read a reference video (mp4/mov/webm/mkv) or image (png/jpg/webp) into frames of `size`:
    the side of a square, or (height, width) (`PipelineConfig.out_hw`).

    Raises InputError naming the file (as `what`: "reference", "scene image") when it is
    missing, empty, unreadable, has no decodable video frame, or pictures over `max_pixels`
    (module doc: refused before they are decoded).
    """
    height, width = target_size(size)
    if max_frames < 1:
        raise ValueError(f"max_frames must be positive (got {max_frames})")
    p = Path(path)
    if not p.exists():
        raise InputError(f"{what} {p} not found; give a video (mp4/mov/webm/mkv) or an image "
                         "(png/jpg/webp) of the person")
    if p.is_dir():
        raise InputError(f"{what} {p} is a folder; give a video or image file")
    if p.stat().st_size == 0:
        raise InputError(f"{what} {p} is empty (0 bytes)")
    header = check_pixels(p, max_pixels, what=f"{what} {p}")
    try:  # the limit also stops the format probe from decoding a picture over it
        container = av.open(str(p), options=decoder_options(max_pixels))
    except (av.FFmpegError, OSError, ValueError) as e:
        raise InputError(f"{what} {p} is not a readable video or image ({_reason(e)})") from e
    with container:
        if not container.streams.video:
            raise InputError(f"{what} {p} has no video or image in it")
        stream = container.streams.video[0]
        w, h = stream.codec_context.width, stream.codec_context.height  # 0 x 0: known once decoded
        if w * h > max_pixels:
            raise too_many_pixels(f"{what} {p}", w, h, max_pixels)
        stream.codec_context.options = decoder_options(max_pixels, header)
        stream.thread_type = "AUTO"
        fmt = container.format.name
        is_image = p.suffix.lower() in IMAGE_SUFFIXES or fmt == "image2" or fmt.endswith("_pipe")
        fps = None if is_image or not stream.average_rate else float(stream.average_rate)
        want = 1 if is_image else max_frames
        frames: list[torch.Tensor] = []
        source_size = (0, 0)
        try:
            for frame in container.decode(stream):
                if frame.width * frame.height > max_pixels:  # the decoder's limit has slack
                    raise too_many_pixels(f"{what} {p}", frame.width, frame.height, max_pixels)
                rgb = upright(frame)
                source_size = (rgb.shape[1], rgb.shape[0])
                frames.append(fit_resize(rgb, height, width))
                if len(frames) >= want:
                    break
        except (av.FFmpegError, OSError, ValueError) as e:
            if not frames:
                raise InputError(f"{what} {p} could not be decoded ({_reason(e)}); it is corrupt, "
                                 f"not a video/image, or its pictures are over the limit of "
                                 f"{megapixels(max_pixels)}") from e
            # a damaged tail: keep the frames decoded before it
    if not frames:
        raise InputError(f"{what} {p} has no decodable video frame")
    frames = frames[:usable_frame_count(len(frames))]
    return Reference(frames=torch.stack(frames), fps=fps, source_size=source_size,
                     is_image=is_image)  # [F, 3, height, width]


def _reason(e: BaseException) -> str:
    """The useful part of a PyAV error (no errno, no repeated file name)."""
    msg = getattr(e, "strerror", None) or str(e)
    return str(msg).rstrip(".")
