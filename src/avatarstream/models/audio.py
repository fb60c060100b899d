"""Speech → one feature vector per video frame (25 fps), offline and streaming, bit-compatible.

Log-mel front end
-----------------
`log_mel(wave)`: 16 kHz mono → natural-log mel power spectrogram.
- STFT with `torch.stft`: periodic Hann window of 400 samples (25 ms), hop 160 samples (10 ms;
  4 mel frames per 40 ms video frame), `n_fft = 400` (201 bins), power `|X|²`.
- Mel filterbank: **HTK** mel scale `mel(f) = 2595·log10(1 + f/700)`, `n_mels` triangular
  filters with edges equally spaced in mel between 0 Hz and 8 kHz, peak 1, **no** area (Slaney)
  normalisation (same as `torchaudio.functional.melscale_fbanks(..., norm=None, mel_scale="htk")`).
- `log(max(mel, floor))`, floor 1e-5 (silence → log(1e-5) ≈ −11.5 in every band).
- Frame alignment (`pad=True`): mel frame m covers samples `[160m − 120, 160m + 280)`, i.e. its
  window is centred on its own 10 ms hop `[160m, 160m + 160)`; the signal is zero outside
  `[0, N)`; `ceil(N / 160)` frames. With `pad=False` frame m covers `[160m, 160m + 400)`.

Encoder and receptive field
---------------------------
`AudioEncoder` is a small conv stack over the log-mel frames (global mel frame m ↔ samples
above), all convolutions *valid* (no padding inside the network):

    c1   Conv1d k=3          mel rate, centred   (1 mel frame back, 1 ahead)     n_mels → C
    c2   Conv1d k=3, dil 2   mel rate, causal    (4 mel frames back)  + residual  C → C
    down Conv1d k=4, s=4     mel → video rate    (video frame f = mel 4f..4f+3)  C → C
    c3   Conv1d k=3          video rate, causal  (2 video frames back) + residual C → C
    out  LayerNorm + Linear                                                        C → out_dim

Video frame f (samples `[640f, 640f + 640)`) therefore depends on exactly the samples
`[640f − left_samples, 640f + 640 + right_samples)` of the zero-extended signal, with
`left_samples = 2200` (137.5 ms) and `right_samples = 280` (17.5 ms). In whole video frames:
`left_frames = 4`, `right_frames = 1`. Because nothing inside the network is padded, the feature
of a frame is a pure function of that sample window, so

- offline `forward(wave)` (= `frames(wave, 0, ceil(N/640))`) and any range `frames(wave, a, b)`
  — including negative frames and frames past the end — are the same function of the
  zero-extended signal, and
- `StreamingAudioFeatures` reproduces them from a rolling buffer (≤ 1e-5; only float rounding of
  different conv lengths differs).

**Latency (look-ahead).** A frame's feature is final once the stream holds 17.5 ms of audio past
the frame's end; counted in whole video frames it is `right_frames = 1` (40 ms). The engine's
per-latent grouping adds `window` more video frames of look-ahead on top (`group_per_latent`).

Plugging in a pretrained speech encoder
---------------------------------------
The engine and `StreamingAudioFeatures` use only this protocol of the audio model:

- `frames(wave [B, N], start, stop, offset=0) -> [B, stop − start, D]`: features of video frames
  `[start, stop)` of the signal whose sample `offset + i` is `wave[:, i]` and which is zero
  elsewhere; `forward(wave) -> [B, ceil(N / 640), D]`;
- `samples_per_frame` (640), `left_frames`, `right_frames` and optionally the tighter
  `left_samples` / `right_samples` (default: the frame counts × 640).

A pretrained encoder such as a local wav2vec2 / HuBERT checkpoint (e.g. loaded with
`transformers.Wav2Vec2Model.from_pretrained(local_dir)`; 50 Hz output, conv front end with a
400-sample receptive field, then full self-attention) fits behind it as a wrapper that (1) bounds
the receptive field: for frames `[start, stop)` it runs the model on the fixed window
`[640·start − L, 640·stop + R)` samples (zero-filled outside the signal) and keeps only the
outputs of the centre part — full attention over an unbounded stream would make every feature
depend on all audio and nothing would ever be final; (2) pools pairs of 50 Hz outputs to 25 Hz
and projects to `out_dim` with a trained linear layer; (3) declares `left_frames = ceil(L/640)`,
`right_frames = ceil(R/640)`. Choosing `R` is the latency trade-off (wav2vec2 features degrade
without ~100–200 ms of right context). Because the window is fixed per frame range, streaming
still equals offline evaluation of the same windowed definition.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

SAMPLE_RATE = 16000


# ------------------------------------------------------------------------------------------------
# Log-mel front end
# ------------------------------------------------------------------------------------------------
def hz_to_mel(f: np.ndarray | float) -> np.ndarray:
    """HTK mel scale: 2595·log10(1 + f/700)."""
    return 2595.0 * np.log10(1.0 + np.asarray(f, dtype=np.float64) / 700.0)


def mel_to_hz(m: np.ndarray | float) -> np.ndarray:
    return 700.0 * (10.0 ** (np.asarray(m, dtype=np.float64) / 2595.0) - 1.0)


@functools.lru_cache(maxsize=16)
def _mel_filterbank_np(n_mels: int, n_fft: int, sample_rate: int, f_min: float,
                       f_max: float) -> np.ndarray:
    n_freqs = n_fft // 2 + 1
    freqs = np.linspace(0.0, sample_rate / 2, n_freqs)  # [n_freqs] Hz of the rfft bins
    edges = mel_to_hz(np.linspace(hz_to_mel(f_min), hz_to_mel(f_max), n_mels + 2))  # [n_mels+2]
    lo, centre, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]  # [n_mels, 1]
    up = (freqs[None] - lo) / (centre - lo)
    down = (hi - freqs[None]) / (hi - centre)
    fb = np.maximum(0.0, np.minimum(up, down))  # [n_mels, n_freqs]
    fb.setflags(write=False)
    return fb


def mel_filterbank(n_mels: int, *, n_fft: int = 400, sample_rate: int = SAMPLE_RATE,
                   f_min: float = 0.0, f_max: float | None = None) -> torch.Tensor:
    """HTK-scale triangular mel filters, peak 1, no area normalisation: [n_mels, n_fft//2 + 1]."""
    f_max = sample_rate / 2 if f_max is None else f_max
    return torch.from_numpy(_mel_filterbank_np(n_mels, n_fft, sample_rate, float(f_min),
                                               float(f_max)).copy()).float()


def _log_mel_core(wave: torch.Tensor, window: torch.Tensor, fb: torch.Tensor, hop: int,
                  floor: float) -> torch.Tensor:
    """wave [B, N] (already padded; frame m = samples [hop·m, hop·m + n_fft)) -> [B, n_mels, M]."""
    n_fft = window.shape[0]
    spec = torch.stft(wave, n_fft=n_fft, hop_length=hop, win_length=n_fft, window=window,
                      center=False, return_complex=True)  # [B, n_fft//2+1, M]
    power = spec.real.square() + spec.imag.square()
    mel = torch.matmul(fb, power)  # [B, n_mels, M]
    return torch.log(torch.clamp(mel, min=floor))


def log_mel(wave: torch.Tensor, n_mels: int = 80, *, sample_rate: int = SAMPLE_RATE,
            n_fft: int = 400, hop: int = 160, pad: bool = True, floor: float = 1e-5) -> torch.Tensor:
    """Log-mel power spectrogram. wave [B, N] float (16 kHz, [-1, 1]) -> [B, n_mels, M].

    pad=True: mel frame m is centred on its hop, covering samples [hop·m − (n_fft−hop)/2, ... +
    n_fft) of the zero-extended signal; M = ceil(N / hop). pad=False: frame m covers
    [hop·m, hop·m + n_fft); M = 1 + (N − n_fft) // hop (N >= n_fft).
    Periodic Hann window, HTK mel filters (see module docstring), natural log floored at `floor`.
    """
    if wave.dim() != 2:
        raise ValueError(f"log_mel expects wave [B, N], got shape {tuple(wave.shape)}")
    wave = wave.float()
    if pad:
        m = -(-wave.shape[1] // hop)
        left = (n_fft - hop) // 2
        right = hop * (m - 1) + n_fft - left - wave.shape[1]
        wave = F.pad(wave, (left, right))
    elif wave.shape[1] < n_fft:
        raise ValueError(f"pad=False needs at least n_fft={n_fft} samples, got {wave.shape[1]}")
    window = torch.hann_window(n_fft, periodic=True, device=wave.device)
    fb = mel_filterbank(n_mels, n_fft=n_fft, sample_rate=sample_rate).to(wave.device)
    return _log_mel_core(wave, window, fb, hop, floor)


# ------------------------------------------------------------------------------------------------
# Encoder
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AudioConfig:
    n_mels: int = 80
    channels: int = 256
    out_dim: int = 128
    sample_rate: int = SAMPLE_RATE
    fps: int = 25
    n_fft: int = 400  # 25 ms window
    hop: int = 160  # 10 ms; must divide the video frame (640 samples)
    floor: float = 1e-5
    mel_mean: float = -4.0  # fixed input normalisation (log_mel − mean) / std
    mel_std: float = 4.0

    @classmethod
    def tiny(cls) -> "AudioConfig":
        return cls(n_mels=40, channels=32, out_dim=16)

    @classmethod
    def small(cls) -> "AudioConfig":
        return cls(n_mels=80, channels=256, out_dim=128)


class _ChannelNorm(nn.LayerNorm):
    """LayerNorm over channels of [B, C, T] (per time step, so it keeps the receptive field)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


class AudioEncoder(nn.Module):
    """Waveform -> per-video-frame features [B, F, out_dim] with a declared receptive field.

    Attributes: `samples_per_frame` (640), `left_samples`/`right_samples` (exact sample context
    before the frame start / after the frame end), `left_frames`/`right_frames` (the same in whole
    video frames; `right_frames` is the look-ahead = latency). See the module docstring.
    """

    # mel-rate context of the layers (mel frames before / after the output frame)
    _C1_LEFT, _C1_RIGHT = 1, 1
    _C2_LEFT = 4  # k=3, dilation 2, causal
    _C3_LEFT = 2  # video rate, k=3, causal

    def __init__(self, config: AudioConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.samples_per_frame = c.sample_rate // c.fps
        if c.sample_rate % c.fps or self.samples_per_frame % c.hop:
            raise ValueError("the hop must divide the video frame (sample_rate / fps samples)")
        self.mels_per_frame = self.samples_per_frame // c.hop
        ch = c.channels
        self.c1 = nn.Conv1d(c.n_mels, ch, 3)
        self.c2 = nn.Conv1d(ch, ch, 3, dilation=2)
        self.down = nn.Conv1d(ch, ch, self.mels_per_frame, stride=self.mels_per_frame)
        self.c3 = nn.Conv1d(ch, ch, 3)
        self.norm = _ChannelNorm(ch)
        self.proj = nn.Conv1d(ch, c.out_dim, 1)
        self.register_buffer("window", torch.hann_window(c.n_fft, periodic=True), persistent=False)
        self.register_buffer("mel_fb", mel_filterbank(c.n_mels, n_fft=c.n_fft,
                                                      sample_rate=c.sample_rate), persistent=False)
        # Receptive field in mel frames, then samples.
        self.mel_left = self._C1_LEFT + self._C2_LEFT + self.mels_per_frame * self._C3_LEFT
        self.mel_right = self._C1_RIGHT
        half = (c.n_fft - c.hop) // 2  # samples a mel window reaches before its hop
        self.left_samples = c.hop * self.mel_left + half
        self.right_samples = c.hop * self.mel_right + (c.n_fft - c.hop - half)
        self.left_frames = math.ceil(self.left_samples / self.samples_per_frame)
        self.right_frames = math.ceil(self.right_samples / self.samples_per_frame)

    @property
    def out_dim(self) -> int:
        return self.config.out_dim

    @property
    def lookahead_ms(self) -> float:
        """Audio needed past a frame's end before its feature is final, in milliseconds."""
        return 1000.0 * self.right_samples / self.config.sample_rate

    # -- core --------------------------------------------------------------------------------------
    def encode_window(self, x: torch.Tensor) -> torch.Tensor:
        """Features from an exact sample window. x [B, S] with S = 640·n + left_samples +
        right_samples, covering samples [640a − left_samples, 640(a+n) + right_samples) of the
        signal -> [B, n, out_dim] for video frames a .. a+n−1."""
        c = self.config
        spf = self.samples_per_frame
        n, rem = divmod(x.shape[1] - self.left_samples - self.right_samples, spf)
        if rem or n < 0:
            raise ValueError(f"window of {x.shape[1]} samples is not 640·n + "
                             f"{self.left_samples + self.right_samples}")
        if n == 0:
            return x.new_zeros(x.shape[0], 0, c.out_dim)
        dtype = self.c1.weight.dtype
        mel = _log_mel_core(x.float(), self.window.float(), self.mel_fb.float(), c.hop, c.floor)
        h = ((mel - c.mel_mean) / c.mel_std).to(dtype)  # [B, n_mels, 4n + mel_left + mel_right]
        h = F.gelu(self.c1(h))  # [B, C, 4n + 4 + 8]
        h = h[..., self._C2_LEFT:] + F.gelu(self.c2(h))  # [B, C, 4n + 8]
        h = F.gelu(self.down(h))  # [B, C, n + 2]
        h = h[..., self._C3_LEFT:] + F.gelu(self.c3(h))  # [B, C, n]
        return self.proj(self.norm(h)).transpose(1, 2)  # [B, n, out_dim]

    def frames(self, wave: torch.Tensor, start: int, stop: int, offset: int = 0) -> torch.Tensor:
        """Features of video frames [start, stop) (may be negative / past the end) of the signal
        whose sample `offset + i` is wave[:, i] and which is zero elsewhere.
        wave [B, N] -> [B, stop − start, out_dim]."""
        if wave.dim() != 2:
            raise ValueError(f"expected wave [B, N], got shape {tuple(wave.shape)}")
        stop = max(stop, start)
        spf = self.samples_per_frame
        lo = spf * start - self.left_samples - offset  # window in wave coordinates
        hi = spf * stop + self.right_samples - offset
        n = wave.shape[1]
        inner = wave[:, min(max(lo, 0), n): max(min(hi, n), 0)]
        if inner.shape[1] == 0:
            window = wave.new_zeros(wave.shape[0], hi - lo)
        else:
            window = F.pad(inner, (max(0, -lo), max(0, hi - n)))
        return self.encode_window(window)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        """Offline: wave [B, N] (zero outside) -> [B, ceil(N / 640), out_dim]."""
        return self.frames(wave, 0, -(-wave.shape[1] // self.samples_per_frame))

    @torch.no_grad()
    def init_random_(self, seed: int) -> None:
        """Deterministic random weights (fan-in scaled; random biases, no zero heads)."""
        _init_random(self, seed)


def _init_random(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if p.dim() >= 2:
            fan_in = p[0].numel()
            val = torch.randn(p.shape, generator=g) / math.sqrt(fan_in)
        elif name.endswith("weight"):  # 1-D weights are norm gains
            val = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        else:
            val = 0.02 * torch.randn(p.shape, generator=g)
        p.copy_(val.to(p.dtype))


# ------------------------------------------------------------------------------------------------
# Streaming
# ------------------------------------------------------------------------------------------------
class StreamingAudioFeatures:
    """Pushed samples -> per-video-frame features equal to the offline computation.

    `push(samples)` appends audio; `end()` marks its end; `available_frames()` is the number of
    video frames (from frame 0) whose features are final; `features(start, stop)` returns
    [1, stop − start, D] == `encoder.frames(whole_wave[None], start, stop)` (zero before sample 0
    and after the end). Frames need not be >= 0.

    Memory: only samples a later call can still need are kept. Calls after the first must be
    contiguous (start == previous stop) or later; after each call everything before
    `640·stop − left_samples` is dropped, so the buffer holds at most left context + the audio
    pushed since the last call. (Before the first call nothing is dropped: read as you push.)
    """

    def __init__(self, encoder: nn.Module) -> None:
        self.encoder = encoder
        self.spf: int = int(getattr(encoder, "samples_per_frame", 640))
        self.left_samples: int = int(getattr(encoder, "left_samples", encoder.left_frames * self.spf))
        self.right_samples: int = int(getattr(encoder, "right_samples",
                                              encoder.right_frames * self.spf))
        self._chunks: list[torch.Tensor] = []  # pushed, not yet merged into _buf
        self._buf = torch.zeros(0)  # samples [_buf_start, _buf_start + len)
        self._buf_start = 0
        self.pushed = 0  # total samples pushed
        self.ended = False
        self._next: int | None = None  # frame the next call must start at (or later)

    # -- input -------------------------------------------------------------------------------------
    def push(self, samples: torch.Tensor) -> None:
        """samples: 1-D float tensor (any length, 16 kHz)."""
        if self.ended:
            raise RuntimeError("push() after end()")
        x = samples.detach().reshape(-1).to("cpu", torch.float32)
        if x.numel():
            self._chunks.append(x)
            self.pushed += x.numel()

    def end(self) -> None:
        self.ended = True

    # -- state -------------------------------------------------------------------------------------
    @property
    def total_frames(self) -> int | None:
        """ceil(samples / 640) after end(), else None."""
        return -(-self.pushed // self.spf) if self.ended else None

    def available_frames(self) -> int:
        """n such that the features of every video frame f < n can no longer change.

        Before end(): frames whose window, including the `right_samples` look-ahead, is fully
        pushed: n = max(0, (pushed − right_samples) // 640). (Frames before 0 are final once
        `right_samples` samples are in; for n >= 1 they are included.) After end(): every frame
        is final; returns the frames up to the end of the audio, ceil(pushed / 640) — later
        frames are silence-padded and may be requested too."""
        n = max(0, (self.pushed - self.right_samples) // self.spf)
        if self.ended:
            n = max(n, -(-self.pushed // self.spf))
        return n

    @property
    def buffer_samples(self) -> int:
        """Samples held in memory."""
        return self._buf.numel() + sum(c.numel() for c in self._chunks)

    def _merge(self) -> None:
        if self._chunks:
            self._buf = torch.cat([self._buf, *self._chunks])
            self._chunks = []

    # -- output ------------------------------------------------------------------------------------
    def features(self, start: int, stop: int) -> torch.Tensor:
        """[1, stop − start, D] features of video frames [start, stop)."""
        if self._next is not None and start < self._next:
            raise ValueError(f"features() must be called with increasing ranges: start {start} < "
                             f"previous stop {self._next}")
        stop = max(stop, start)
        if not self.ended and self.spf * stop + self.right_samples > self.pushed:
            raise RuntimeError(f"frames up to {stop} are not final yet "
                               f"(available: {self.available_frames()})")
        self._merge()
        lo = self.spf * start - self.left_samples
        if stop > start and min(max(lo, 0), self.pushed) < self._buf_start:
            raise RuntimeError("audio needed for these frames was already released")
        p = next(self.encoder.parameters(), None)
        buf = self._buf if p is None else self._buf.to(p.device)
        out = self.encoder.frames(buf[None], start, stop, offset=self._buf_start)
        self._next = stop
        # Drop what the next (contiguous) call cannot need.
        keep_from = self.spf * stop - self.left_samples
        drop = min(max(0, keep_from - self._buf_start), self._buf.numel())
        if drop:
            self._buf = self._buf[drop:].clone()
            self._buf_start += drop
        return out


# ------------------------------------------------------------------------------------------------
# Grouping per latent
# ------------------------------------------------------------------------------------------------
def latent_frame_range(position: int, window: int = 1, temporal_stride: int = 4) -> tuple[int, int]:
    """Video frames [e − s − w, e + w) used by timeline latent `position`, where e is the end of
    its video span (latent 0 → frame 0 alone, latent j → frames sj − s + 1 .. sj, so e = sj + 1).
    Same as the engine's `AudioContext._frame_range`."""
    if position < 0:
        raise ValueError(f"latent position must be >= 0, got {position}")
    e = temporal_stride * position + 1
    return e - temporal_stride - window, e + window


def group_per_latent(frame_feats: torch.Tensor, positions: Sequence[int] | torch.Tensor,
                     window: int = 1, *, first_frame: int = 0,
                     temporal_stride: int = 4) -> torch.Tensor:
    """Per-video-frame features -> per-latent audio tokens.

    frame_feats [B, F, D]: features of video frames first_frame .. first_frame + F − 1.
    positions: T timeline latent indices. Returns [B, T, 4 + 2·window, D]: latent p takes frames
    `latent_frame_range(p, window)` (latent 0: frames −3−w .. w; latent j: 4j−3−w .. 4j+w).
    Frames outside the given range are zeros; to match the engine exactly (which uses the
    encoder's silence features there), pass features covering the range, e.g.
    `encoder.frames(wave, -(4 + window), F + window)` with `first_frame=-(4 + window)`.
    """
    b, f, d = frame_feats.shape
    pos = [int(p) for p in (positions.tolist() if isinstance(positions, torch.Tensor) else positions)]
    a = temporal_stride + 2 * window
    if not pos:
        return frame_feats.new_zeros(b, 0, a, d)
    idx = torch.stack([torch.arange(*latent_frame_range(p, window, temporal_stride)) for p in pos])
    idx = idx.to(frame_feats.device) - first_frame  # [T, A] indices into frame_feats
    valid = (idx >= 0) & (idx < f)
    out = frame_feats[:, idx.clamp(0, max(f - 1, 0))] if f else frame_feats.new_zeros(b, *idx.shape, d)
    return out * valid[None, :, :, None].to(out.dtype)  # [B, T, A, D]
