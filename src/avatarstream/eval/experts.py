"""Expert networks that judge pixels and audio only (issue 4, item 4).

- `FaceStateNet`: a locator on the whole frame (96x96) finds the mouth centre and the face scale;
  a face head on a face crop (64x64) gives head pose and blink; a mouth head on a mouth crop
  (48x48) gives mouth opening, width and rounding. Crops are taken with `crop` (bilinear, any
  sub-pixel centre), so every later expert sees the face where the locator put it.
- `SyncNet`: 5 grey mouth crops (0.2 s of video) and 0.2 s of log-mel audio are embedded on the
  unit sphere; aligned pairs are close (SyncNet style, trained contrastively against shifted audio).
- `IdentityNet`: a face crop (64x64) -> unit embedding; same identity close across scene, pose
  and expression.

All frames enter as float tensors [N, 3, 256, 256] in [0, 1] (`to_canvas` resizes any frame size
to the 256 canvas the locator was trained on). Weights live in `avatarstream/assets/experts/`; an
evaluation-only second sync / identity pair, which no training reward saw, in `assets/experts-independent/`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from avatarstream.errors import ConfigError
from avatarstream.models.audio import log_mel

CANVAS = 256  # frames are evaluated on a 256x256 canvas
FPS = 25
SAMPLE_RATE = 16000
HOP = 160  # log-mel hop: 4 mel frames per video frame
MEL_PER_FRAME = SAMPLE_RATE // FPS // HOP  # 4
N_MELS = 40
SYNC_FRAMES = 5  # video frames per sync window (0.2 s)
SYNC_MELS = SYNC_FRAMES * MEL_PER_FRAME  # 20 mel frames (0.2 s)
LOC_SIZE, FACE_SIZE, MOUTH_SIZE, SYNC_SIZE = 96, 64, 48, 40
# crop geometry, in units of the face scale a (face half-width in canvas pixels)
FACE_SIDE, FACE_DY = 4.6, -1.25  # face crop: side, centre offset from the mouth (up)
MOUTH_SIDE = 2.2  # mouth crop side
# regression targets of the face-state net (normalised as below)
STATE_KEYS = ("mouth_x", "mouth_y", "scale", "yaw", "pitch", "roll", "blink", "open", "width", "round")
POSE_SCALE = 10.0  # degrees per unit

ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "experts"
# evaluation-only sync and identity experts trained apart from the bundled ones (which a training
# reward may use): other identities, scenes, sentences' draws and seeds; face_state is shared
INDEPENDENT_DIR = ASSET_DIR.parent / "experts-independent"
EXPERT_SETS = {"bundled": ASSET_DIR, "independent": INDEPENDENT_DIR}


def to_canvas(frames: np.ndarray | torch.Tensor) -> torch.Tensor:
    """[N, H, W, 3] uint8 (any square-ish size) -> [N, 3, 256, 256] float in [0, 1]; non-square
    frames are centre-cropped to a square first (as `media.reference.square_resize`)."""
    x = torch.as_tensor(np.ascontiguousarray(frames) if isinstance(frames, np.ndarray) else frames)
    if x.dim() != 4 or x.shape[-1] != 3:
        raise ValueError(f"frames must be [N, H, W, 3], got {tuple(x.shape)}")
    n, h, w, _ = x.shape
    s = min(h, w)
    x = x[:, (h - s) // 2:(h - s) // 2 + s, (w - s) // 2:(w - s) // 2 + s]
    x = x.permute(0, 3, 1, 2).float().div_(255.0)
    if s != CANVAS:
        x = F.interpolate(x, size=(CANVAS, CANVAS), mode="bilinear", align_corners=False, antialias=s > CANVAS)
    return x.contiguous()


def crop(frames: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor, side: torch.Tensor, out: int) -> torch.Tensor:
    """Axis-aligned square crops. frames [N, C, S, S]; cx, cy, side [N] in canvas pixels (pixel
    centres at i + 0.5); returns [N, C, out, out] (bilinear, zeros outside the frame)."""
    n, _, h, w = frames.shape
    theta = torch.zeros(n, 2, 3, dtype=frames.dtype)
    theta[:, 0, 0] = side / w
    theta[:, 1, 1] = side / h
    theta[:, 0, 2] = cx / w * 2 - 1
    theta[:, 1, 2] = cy / h * 2 - 1
    grid = F.affine_grid(theta, [n, frames.shape[1], out, out], align_corners=False)
    return F.grid_sample(frames, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def face_box(mx: torch.Tensor, my: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Face crop (cx, cy, side) [N] each from the mouth centre and face scale a [N] (pixels)."""
    return mx, my + FACE_DY * scale, FACE_SIDE * scale


def mouth_box(mx: torch.Tensor, my: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mouth crop (cx, cy, side) [N] each."""
    return mx, my, MOUTH_SIDE * scale


def grey(x: torch.Tensor) -> torch.Tensor:
    """[N, 3, H, W] -> [N, 1, H, W] luma (BT.601)."""
    return (0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3])


def _conv(cin: int, cout: int, stride: int | tuple[int, int] = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class _Trunk(nn.Module):
    """Small CNN: [N, cin, s, s] -> [N, out_dim] (global average pooled); resolution /2 per block
    after a stride-2 stem."""

    def __init__(self, cin: int, width: int, blocks: int) -> None:
        super().__init__()
        layers = [_conv(cin, width, 2)]
        c = width
        for i in range(blocks):
            co = min(width * 4, c * 2) if i < 2 else c
            layers += [_conv(c, co, 2), _conv(co, co)]
            c = co
        self.body = nn.Sequential(*layers)
        self.out_dim = c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).mean((2, 3))


class FaceStateNet(nn.Module):
    """Frame -> face state, from pixels alone.

    locator: [N, 3, 96, 96] -> mouth (x, y) and log face scale; face head: [N, 3, 64, 64] face crop
    -> yaw, pitch, roll, blink; mouth head: [N, 3, 48, 48] mouth crop -> open, width, round.
    """

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.locator = _Trunk(3, width, 4)
        self.loc_out = nn.Linear(self.locator.out_dim, 3)
        self.face = _Trunk(3, width, 3)
        self.face_out = nn.Linear(self.face.out_dim, 4)
        self.mouth = _Trunk(3, width, 3)
        self.mouth_out = nn.Linear(self.mouth.out_dim, 3)

    def locate(self, canvas: torch.Tensor) -> torch.Tensor:
        """canvas [N, 3, 256, 256] -> [N, 3]: mouth x, y (pixels) and face scale a (pixels)."""
        x = F.interpolate(canvas, size=(LOC_SIZE, LOC_SIZE), mode="area")
        o = self.loc_out(self.locator(x))
        return torch.stack([(o[:, 0] + 0.5) * CANVAS, (o[:, 1] + 0.5) * CANVAS, 50.0 * torch.exp(o[:, 2])], 1)

    def face_state(self, face: torch.Tensor) -> torch.Tensor:
        """face crop [N, 3, 64, 64] -> [N, 4]: yaw, pitch, roll (degrees), blink (0 open .. 1 closed)."""
        o = self.face_out(self.face(face))
        return torch.cat([o[:, :3] * POSE_SCALE, o[:, 3:4]], 1)

    def mouth_state(self, mouth: torch.Tensor) -> torch.Tensor:
        """mouth crop [N, 3, 48, 48] -> [N, 3]: opening (0..1), width (-1..1), rounding (0..1)."""
        return self.mouth_out(self.mouth(mouth))

    def forward(self, canvas: torch.Tensor) -> torch.Tensor:
        """canvas [N, 3, 256, 256] -> [N, 10] in STATE_KEYS order."""
        loc = self.locate(canvas)
        fb = face_box(loc[:, 0], loc[:, 1], loc[:, 2])
        mb = mouth_box(loc[:, 0], loc[:, 1], loc[:, 2])
        fs = self.face_state(crop(canvas, *fb, FACE_SIZE))
        ms = self.mouth_state(crop(canvas, *mb, MOUTH_SIZE))
        return torch.cat([loc, fs, ms], 1)


class SyncNet(nn.Module):
    """Two towers into a shared unit sphere.

    video: [N, 5, 40, 40] grey mouth crops of 5 consecutive frames -> [N, dim];
    audio: [N, 1, 40, 20] normalised log-mel (40 mels x 20 hops = 0.2 s) -> [N, dim].
    """

    def __init__(self, width: int = 24, dim: int = 64) -> None:
        super().__init__()
        self.video = _Trunk(SYNC_FRAMES, width, 3)
        self.video_out = nn.Linear(self.video.out_dim, dim)
        self.audio = nn.Sequential(_conv(1, width, (2, 1)), _conv(width, width * 2, 2), _conv(width * 2, width * 2),
                                   _conv(width * 2, width * 4, 2), _conv(width * 4, width * 4))
        self.audio_out = nn.Linear(width * 4, dim)
        self.register_buffer("mel_mean", torch.zeros(N_MELS, 1))
        self.register_buffer("mel_std", torch.ones(N_MELS, 1))

    def embed_video(self, v: torch.Tensor) -> torch.Tensor:
        """[N, 5, 40, 40] in [0, 1] -> [N, dim] unit vectors."""
        v = v - v.mean((1, 2, 3), keepdim=True)  # brightness-invariant
        return F.normalize(self.video_out(self.video(v)), dim=1)

    def embed_audio(self, a: torch.Tensor) -> torch.Tensor:
        """[N, 1, 40, 20] raw log-mel -> [N, dim] unit vectors."""
        a = (a - self.mel_mean) / self.mel_std
        return F.normalize(self.audio_out(self.audio(a).mean((2, 3))), dim=1)


class IdentityNet(nn.Module):
    """face crop [N, 3, 64, 64] in [0, 1] -> [N, dim] unit identity embedding."""

    def __init__(self, width: int = 24, dim: int = 64) -> None:
        super().__init__()
        self.trunk = _Trunk(3, width, 4)
        self.out = nn.Linear(self.trunk.out_dim, dim)

    def forward(self, face: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.out(self.trunk(face)), dim=1)


def audio_mel(audio: np.ndarray | torch.Tensor) -> torch.Tensor:
    """16 kHz mono [N] -> log-mel [40, M], M = ceil(N / 160); mel frame m is centred at sample
    160 m + 80, so video frame t owns mel frames 4t .. 4t + 3."""
    x = torch.as_tensor(np.asarray(audio, np.float32)).reshape(1, -1)
    if x.shape[1] == 0:
        return torch.zeros(N_MELS, 0)
    return log_mel(x, N_MELS, hop=HOP)[0]


def mel_windows(mel: torch.Tensor, frames: int, margin: int = 0) -> torch.Tensor:
    """Audio window of every video frame position t in [-margin, frames + margin) (centre of video
    frames t-2 .. t+2): mel frames 4(t-2) .. 4(t+3) - 1; outside the audio the window is silence
    (log floor). mel [40, M] -> [frames + 2 margin, 1, 40, 20]."""
    pad = MEL_PER_FRAME * (margin + SYNC_FRAMES)
    floor = float(np.log(1e-5))
    need = MEL_PER_FRAME * frames + 2 * pad
    m = torch.full((N_MELS, need), floor)
    n = min(mel.shape[1], MEL_PER_FRAME * frames + pad)
    m[:, pad:pad + n] = mel[:, :n]
    t = torch.arange(-margin, frames + margin)
    starts = (t - 2) * MEL_PER_FRAME + pad
    idx = starts[:, None] + torch.arange(SYNC_MELS)[None]  # [frames + 2 margin, 20]
    return m[:, idx].permute(1, 0, 2).unsqueeze(1).contiguous()


def video_windows(mouths: torch.Tensor) -> torch.Tensor:
    """grey mouth crops [F, 1, 40, 40] -> [F, 5, 40, 40]: frames t-2 .. t+2 (edge frames repeated)."""
    f = mouths.shape[0]
    idx = (torch.arange(f)[:, None] + torch.arange(-2, 3)[None]).clamp(0, f - 1)
    return mouths[idx, 0]


@dataclass
class Experts:
    """The three bundled experts, in eval mode."""

    face: FaceStateNet
    sync: SyncNet
    identity: IdentityNet


_CACHE: dict[str, Experts] = {}


def expert_folder(folder: str | Path | None = None) -> Path:
    """The folder of an expert set: None or "bundled" -> the bundled assets, "independent" -> the
    evaluation-only set (`INDEPENDENT_DIR`), anything else a folder path."""
    if folder is None:
        return ASSET_DIR
    return EXPERT_SETS.get(str(folder), Path(folder))


def load_experts(folder: str | Path | None = None) -> Experts:
    """Load face_state/sync/identity .safetensors from `folder` (None / "bundled", "independent" or
    a path; see `expert_folder`). A folder without face_state.safetensors takes the bundled one:
    the face-state locator only places crops, and the independent set shares it."""
    from safetensors.torch import load_file

    folder = expert_folder(folder)
    if not folder.is_dir():
        raise ConfigError(f"expert folder not found: {folder} (give bundled, independent or a folder of "
                          "face_state/sync/identity .safetensors)")
    key = str(folder.resolve())
    if key in _CACHE:
        return _CACHE[key]
    nets = {"face_state": FaceStateNet(), "sync": SyncNet(), "identity": IdentityNet()}
    for name, net in nets.items():
        path = folder / f"{name}.safetensors"
        if name == "face_state" and not path.exists():
            path = ASSET_DIR / path.name
        if not path.exists():
            raise ConfigError(f"expert weights missing: {path} (train them: python -m avatarstream.eval.train_experts)")
        net.load_state_dict(load_file(str(path)))
        net.eval()
    ex = Experts(nets["face_state"], nets["sync"], nets["identity"])
    _CACHE[key] = ex
    return ex
