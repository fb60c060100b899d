"""ReferenceStage: encode the reference once per request (context-level cache).

Reference frames -> causal VAE latents at both resolutions -> per-layer reference K/V of the DiT
and of the SR refiner (attention-level cache), with a validity mask that drops frames with no
usable content; the scene frame (the first usable LR latent and its motion token) into the
rolling store; the text prompt -> text tokens. Nothing here runs again for later chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from avatarstream.engine.module import Module
from avatarstream.engine.session import SessionState
from avatarstream.errors import InputError


def frame_validity(video: torch.Tensor, *, min_std: float = 0.02) -> torch.Tensor:
    """[F] bool: a frame is usable if it is not (nearly) uniform. video [3, F, H, W] in [-1, 1].

    A placeholder for a face detector (the eval package brings one): blank, black or frozen-
    uniform frames are dropped from the reference keys instead of diluting them. Uniform means
    every channel is (nearly) constant over the frame: the spread is taken per channel, so one
    flat colour, grey or not (RGB (0, 128, 255)), is blank; a std over the channels together
    would count the differences between R, G and B as picture content.
    """
    return video.flatten(2).std(dim=2).amax(dim=0) > min_std  # [3, F] per channel -> [F]


def check_reference_size(frames: torch.Tensor, out_hw: tuple[int, int] | None, what: str = "reference") -> None:
    """An InputError when frames `[F, 3, H, W]` are not the size the model renders (a reference
    loaded, or an avatar prepared, for another geometry); out_hw None: not checked."""
    if out_hw is not None and tuple(frames.shape[-2:]) != tuple(out_hw):
        h, w = frames.shape[-2:]
        raise InputError(f"the {what} is {w}x{h} pixels (width x height) and the model renders "
                         f"{out_hw[1]}x{out_hw[0]}; load it at that size (media.reference.load_reference"
                         f"(size=config.out_hw)) or upload the avatar again")


class ReferenceStage:
    name = "reference"

    def __init__(self, dit: Module, refiner: Module | None, vae: Module, text: Module, *,
                 lr_size: int | tuple[int, int], temporal_stride: int = 4,
                 ref_t_position: float = -8.0, out_hw: tuple[int, int] | None = None) -> None:
        """lr_size: (h, w) in pixels the DiT works at (`PipelineConfig.lr_hw`), or the side of a
        square; out_hw: (H, W) the frames and scene must have (None: not checked)."""
        self.dit, self.refiner, self.vae, self.text = dit, refiner, vae, text
        self.out_hw = out_hw
        self.lr_hw = (lr_size, lr_size) if isinstance(lr_size, int) else tuple(lr_size)
        self.stride = temporal_stride
        self.ref_t_position = ref_t_position
        self.seconds = 0.0

    def latent_validity(self, frame_valid: torch.Tensor) -> torch.Tensor:
        """[T] bool: latent frame j is valid when all video frames it encodes are valid."""
        s = self.stride
        first = frame_valid[:1]
        rest = frame_valid[1:].reshape(-1, s).all(dim=1) if frame_valid.numel() > 1 else first[:0]
        return torch.cat([first, rest])

    def run(self, state: SessionState, frames: torch.Tensor, prompt: str = "",
            scene: torch.Tensor | None = None) -> None:
        """frames: [F, 3, H, W] uint8 reference frames at the output (HR) resolution; scene:
        [1, 3, H, W] uint8, the first frame to start from when it is not the reference's (the
        person from the reference placed in another picture: Avatar V's cross-scene setting)."""
        import time

        t0 = time.perf_counter()
        check_reference_size(frames, self.out_hw)
        if scene is not None:
            check_reference_size(scene, self.out_hw, "scene image")
        usable = 1 + self.stride * ((frames.shape[0] - 1) // self.stride)  # 1 + 4k layout
        video = frames[:usable].permute(1, 0, 2, 3).float() / 127.5 - 1.0  # [3, F, H, W]
        valid_f = frame_validity(video)
        valid = self.latent_validity(valid_f)  # [R]
        if not bool(valid.any()):
            raise InputError("the reference has no usable frame (all frames are blank); "
                             "give a video or image that shows the person's face")
        hr_video = video.unsqueeze(0)  # [1, 3, F, H, W]
        hr_lat, _ = self.vae.call("encode", hr_video)  # [1, C, R, H/8, W/8] (means)
        if self.lr_hw == tuple(hr_video.shape[-2:]):  # a direct model: the DiT works at the output size
            lr_lat = hr_lat
        else:
            lr_video = F.interpolate(hr_video, size=(usable, *self.lr_hw), mode="area")  # [1, 3, F, h, w]
            lr_lat, _ = self.vae.call("encode", lr_video)  # [1, C, R, h/8, w/8]
        r = hr_lat.shape[2]
        t_pos = torch.full((r,), self.ref_t_position)
        state.dit_reference = self.dit.call("encode_reference", lr_lat, valid[None], t_pos)
        state.refiner_reference = (None if self.refiner is None else
                                   self.refiner.call("encode_reference", hr_lat, valid[None], t_pos))
        # the scene frame: the first usable reference latent (a one-image latent when that is
        # frame 0) with its motion token, what ref2v / N chunks are given at their frame 0
        if scene is None:
            j0 = int(valid.nonzero()[0])
            state.store.set_scene(lr_lat[:, :, j0].float(), state.dit_reference.motion[:, 0].float())
        else:
            sv = scene[:1].permute(1, 0, 2, 3).float().unsqueeze(0) / 127.5 - 1.0  # [1, 3, 1, H, W]
            if not bool(frame_validity(sv[0]).all()):
                raise InputError("the scene image is blank; give a picture to start from")
            sv = F.interpolate(sv, size=(1, *self.lr_hw), mode="area")
            s_lat, _ = self.vae.call("encode", sv)  # [1, C, 1, h, w]
            motion = self.dit.call("extract_motion", s_lat)  # [1, 1, Dm]
            state.store.set_scene(s_lat[:, :, 0].float(), motion[:, 0].float())
        state.text, state.text_mask = self.text.call("encode", [prompt])
        self.seconds += time.perf_counter() - t0
