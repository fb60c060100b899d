"""HandoffSchedule: FlashHead's continuity (docs/real-models.md, "The official FlashHead loop") as a continuity schedule.

Every chunk is a whole `chunk`-latent window denoised with full attention. Its first latents are
*given*: chunk 0 the scene frame (the reference's latent 0: `SCENE_CHUNK`), every later chunk the
previous chunk's last `overlap` latents as the decode stage *re-encoded them* from its decoded,
colour-corrected pixels (the hand-off; the stage puts them in the store as that chunk's kept
frames). A chunk adds `chunk − overlap` latents of new video: frames [h, F) of its F pixel frames,
h = (overlap − 1)·s + 1 (s the VAE's temporal stride: 5 of 33 frames for Pro), dropped even in
chunk 0, whose first frames face the silence before the audio.

Timeline. Chunk k publishes video frames [k·N, (k + 1)·N) (N = (chunk − overlap)·s new frames)
and needs the audio up to frame (k + 1)·N. Plan positions are latents of the engine's clock
(4 frames, the first alone: `engine.clock`), used only to pull that audio and to carry it: with the
`AudioContext` window `w = s − 4`, latent j of chunk k sits at
p = k·N/4 + (s/4)·(j − 2) + 1 (clamped at 0), whose clock windows cover frames [k·N, (k+1)·N)
and reach one frame past them (`chunk_frames` says which; the audio stage cuts them out).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from avatarstream.engine.schedule import SCENE_CHUNK, ChunkPlan, GivenFrame, _require


@dataclass
class HandoffSchedule:
    chunk: int
    overlap: int = 2
    stride: int = 4  # video frames per latent of the model's VAE (Wan 4, LTX 8)
    name: str = "handoff"
    uses_appearance_anchor: bool = False
    _next_id: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        _require(self.chunk > self.overlap >= 1 and self.stride % 4 == 0,
                 "handoff schedule needs chunk > overlap >= 1 and a stride that is a multiple of 4",
                 chunk=self.chunk, overlap=self.overlap, stride=self.stride)

    @property
    def new_frames(self) -> int:
        """Video frames each chunk publishes."""
        return (self.chunk - self.overlap) * self.stride

    @property
    def window(self) -> int:
        """The `AudioContext` window (`PipelineConfig.audio_window`) the positions assume."""
        return self.stride - 4

    def positions(self, k: int) -> tuple[int, ...]:
        base, step = k * self.new_frames // 4, self.stride // 4
        return tuple(max(0, base + step * (j - 2) + 1) for j in range(self.chunk))

    def chunk_frames(self, k: int) -> tuple[int, int]:
        """Video frames [start, stop) chunk k publishes (and whose audio it adds)."""
        return k * self.new_frames, (k + 1) * self.new_frames

    def horizon(self) -> int:
        return self.positions(self._next_id)[-1] + 1

    def next_chunk(self, total: int | None) -> ChunkPlan | None:
        """total: timeline latents once the audio has ended; a chunk is made while its first frame
        may lie before the end (4·(total − 1) + 1 frames at most; the decode stage trims)."""
        k = self._next_id
        if total is not None and k * self.new_frames >= 4 * (total - 1) + 1:
            return None
        self._next_id += 1
        o, c = self.overlap, self.chunk
        given = ((GivenFrame(0, SCENE_CHUNK, 0),) if k == 0 else
                 tuple(GivenFrame(i, k - 1, c - o + i) for i in range(o)))
        return ChunkPlan(id=k, kind="handoff", positions=self.positions(k), given=given,
                         emit=(o, c), publish=(k,), keep=tuple(range(c - o, c)),
                         release=(k - 1,) if k else ())
