"""One synthetic talking-head clip: a person (identity seed) in a scene, speaking sentences with
a voice, rendered at 25 fps with 16 kHz audio and exact per-frame ground truth.

`Clip(spec)` lays out the speech (a lead-in silence, sentences from the corpus of the voice's
language at a slightly varied speaking rate, pauses between them), turns the phone timings into a
mouth track (`visemes.mouth_track`, shaped by the identity's talking style), adds head motion,
blinks, brows, gaze and smile (`motion.motion_track`), and renders every frame from those states.
Video and audio have the same duration: `frames = round(seconds · 25)`, `samples = frames · 640`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from avatarstream.data.corpus import SENTENCES
from avatarstream.data.features import FaceState
from avatarstream.data.identity import Identity
from avatarstream.data.motion import MotionTrack, motion_track
from avatarstream.data.render import AvatarRenderer
from avatarstream.data.scene import Scene
from avatarstream.media.speech import Phone, SpeechSynthesizer, voice_by_id
from avatarstream.data.splits import check_split, derive_seed
from avatarstream.data.visemes import MouthTrack, mouth_track
from avatarstream.errors import InputError

FPS = 25
SAMPLE_RATE = 16000
SPF = SAMPLE_RATE // FPS  # audio samples per video frame
RENDER_BATCH = 50  # frames rendered at once (bounds memory for long clips)
SILENCE = {"flite": "pau", "espeak": "_"}


@dataclass(frozen=True)
class ClipSpec:
    """Everything that determines a clip. `seed` draws the sentences, pauses, rate and motion."""

    identity: int
    scene: int
    voice: str
    seed: int
    seconds: float
    size: int = 256
    split: str = "train"

    @property
    def frames(self) -> int:
        return int(round(self.seconds * FPS))

    @property
    def key(self) -> str:
        return f"i{self.identity}-s{self.scene}-{self.seed}"


def _r(x: np.ndarray, nd: int = 4) -> list[float]:
    return [round(float(v), nd) for v in np.asarray(x, np.float64)]


def face_states(mouth: MouthTrack, motion: MotionTrack) -> list[FaceState]:
    return [FaceState(open=float(mouth.open[i]), width=float(mouth.width[i]), round=float(mouth.round[i]),
                      teeth=float(mouth.teeth[i]), smile=float(motion.smile[i]), yaw=float(motion.yaw[i]),
                      pitch=float(motion.pitch[i]), roll=float(motion.roll[i]), blink=float(motion.blink[i]),
                      brow=float(motion.brow[i]), gaze_x=float(motion.gaze_x[i]), gaze_y=float(motion.gaze_y[i]))
            for i in range(len(mouth.open))]


def fill_gaps(phones: list[Phone], end: float, engine: str) -> list[Phone]:
    """Silence phones over every gap so the list covers [0, end] without holes."""
    out: list[Phone] = []
    t = 0.0
    for p in phones:
        if p.start > t + 1e-6:
            out.append(Phone(t, p.start, SILENCE[engine], engine))
        out.append(p)
        t = max(t, p.end)
    if end > t + 1e-6:
        out.append(Phone(t, end, SILENCE[engine], engine))
    return out


class Clip:
    """A rendered clip. `audio` [samples] float32, `phones`, `states` (one `FaceState` a frame) and
    `annotations` are made at construction (fast); pixels on demand by `frames()` / `iter_frames()`."""

    def __init__(self, spec: ClipSpec, synth: SpeechSynthesizer | None = None) -> None:
        check_split(spec.split)
        if spec.seconds <= 0 or spec.frames < 1:
            raise InputError(f"a clip needs a positive duration, got {spec.seconds} s")
        self.spec = spec
        self.identity = Identity.from_seed(spec.identity)
        self.scene = Scene.from_seed(spec.scene)
        self.voice = voice_by_id(spec.voice)
        self.renderer = AvatarRenderer(self.identity, self.scene, spec.size)
        self.audio, self.phones, self.texts = self._speech(synth or SpeechSynthesizer())
        style = self.identity.style
        n = spec.frames
        self.mouth = mouth_track(self.phones, n, FPS, sharpness=style.sharpness, amplitude=style.mouth_amplitude)
        self.motion = motion_track(style, n, FPS, self.mouth.speaking, self.phones, derive_seed("motion", spec.seed))
        self.states = face_states(self.mouth, self.motion)
        self.annotations = self._annotate()

    def _speech(self, synth: SpeechSynthesizer) -> tuple[np.ndarray, list[Phone], list[str]]:
        """Lead-in 0.4–1.0 s, then sentences separated by 0.4–0.9 s pauses until the clip is full
        (the last one may be cut off by the clip's end, as a chunk of a longer take would be)."""
        spec, voice = self.spec, self.voice
        rng = np.random.default_rng(derive_seed("speech", spec.seed))
        total = spec.frames * SPF
        end = total / SAMPLE_RATE
        audio = np.zeros(total, np.float32)
        sentences = SENTENCES[voice.language]
        order = rng.permutation(len(sentences))
        phones: list[Phone] = []
        texts: list[str] = []
        pos = float(rng.uniform(0.2, 0.8))
        k = 0
        while pos < end - 0.4:
            text = sentences[int(order[k % len(order)])]
            k += 1
            u = synth.speak(text, voice, speed=round(float(rng.uniform(0.92, 1.08)), 2))  # rounded: memo hits
            a = int(round(pos * SAMPLE_RATE))
            seg = u.audio[: total - a]
            audio[a:a + len(seg)] = seg
            pos = a / SAMPLE_RATE
            phones += [Phone(p.start + pos, min(p.end + pos, end), p.symbol, p.engine) for p in u.phones
                       if p.start + pos < end]
            texts.append(text)
            pos += len(u.audio) / SAMPLE_RATE + float(rng.uniform(0.0, 0.5))  # + ~0.4 s of the utterances' own edges
        return audio, fill_gaps(phones, end, voice.engine), texts

    def _annotate(self) -> dict[str, Any]:
        spec, m, mo = self.spec, self.mouth, self.motion
        xy = np.array([self.renderer.mouth_xy(s) for s in self.states], np.float64)  # [F, 2]
        per_frame = {"mouth_open": _r(m.open), "mouth_width": _r(m.width), "mouth_round": _r(m.round),
                     "teeth": _r(m.teeth), "smile": _r(mo.smile), "yaw": _r(mo.yaw), "pitch": _r(mo.pitch),
                     "roll": _r(mo.roll), "blink": _r(mo.blink), "brow": _r(mo.brow), "gaze_x": _r(mo.gaze_x),
                     "gaze_y": _r(mo.gaze_y), "mouth_x": _r(xy[:, 0], 3), "mouth_y": _r(xy[:, 1], 3),
                     "speaking": [bool(v) for v in m.speaking], "viseme": [int(v) for v in m.viseme]}
        return {"identity": spec.identity, "scene": spec.scene, "voice": spec.voice, "language": self.voice.language,
                "seed": spec.seed, "split": spec.split, "size": spec.size, "fps": FPS, "sample_rate": SAMPLE_RATE,
                "frames": spec.frames, "seconds": spec.frames / FPS, "text": " ".join(self.texts),
                "sentences": list(self.texts),
                "style": {k: round(float(v), 4) for k, v in asdict(self.identity.style).items()},
                "scene_info": {"background": self.scene.background, "light_azimuth": round(float(self.scene.light_azimuth), 4),
                               "scale": round(float(self.scene.scale), 4)},
                "phones": [[round(p.start, 4), round(p.end, 4), p.symbol] for p in self.phones],
                "per_frame": per_frame}

    def annotations_json(self) -> str:
        return json.dumps(self.annotations, sort_keys=True, ensure_ascii=False)

    def iter_frames(self, batch: int = RENDER_BATCH) -> Iterator[np.ndarray]:
        """Frames one at a time ([S, S, 3] uint8), rendered `batch` at once."""
        for a in range(0, len(self.states), batch):
            yield from self.renderer.render_many(self.states[a:a + batch])

    def frames(self) -> np.ndarray:
        """All frames [F, S, S, 3] uint8."""
        return np.stack(list(self.iter_frames()))

    @property
    def seconds(self) -> float:
        return self.spec.frames / FPS


def idle_states(identity: Identity, frames: int, seed: int = 0) -> list[FaceState]:
    """A listening face: mouth shut, sway, blinks, gaze (no speech)."""
    n = max(1, frames)
    quiet = MouthTrack(*(np.zeros(n, np.float32) for _ in range(4)), speaking=np.zeros(n, bool),
                       viseme=np.zeros(n, np.int64))
    return face_states(quiet, motion_track(identity.style, n, FPS, quiet.speaking, [], derive_seed("idle", seed)))


def render_reference(identity: int, scene: int, size: int = 256, frames: int = 1, seed: int = 0) -> np.ndarray:
    """A reference video of a person listening (idle motion, mouth shut): [frames, S, S, 3] uint8."""
    idn = Identity.from_seed(identity)
    return AvatarRenderer(idn, Scene.from_seed(scene), size).render_many(idle_states(idn, frames, seed))
