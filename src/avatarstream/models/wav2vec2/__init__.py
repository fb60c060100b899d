"""wav2vec 2.0 audio features for the real checkpoints (our own port; no `transformers` at run time).

- `model.py`: the network (`Wav2Vec2`, `Wav2Vec2Config` with the base and large presets), the
  waveform normalisation and the linear frame resampling both official paths use;
- `flashhead.py`: FlashHead's path, 25 fps features over a bounded trailing window
  (`FlashHeadAudioStream`) up to the DiT's audio context `[1, frames, 5, L, C]`;
- `liveavatar.py`: LiveAvatar's whole-clip path up to the DiT's `audio_input` `[1, L+1, C, frames]`.

Loading a checkpoint (HF folder keys, both weight-norm forms) is `weights/wav2vec2.py`.
"""

from avatarstream.models.wav2vec2.flashhead import (FlashHeadAudioConfig, FlashHeadAudioStream,
                                                    flashhead_audio_context)
from avatarstream.models.wav2vec2.liveavatar import LiveAvatarAudioConfig, liveavatar_audio_input
from avatarstream.models.wav2vec2.model import Wav2Vec2, Wav2Vec2Config, normalize_waveform

__all__ = ["FlashHeadAudioConfig", "FlashHeadAudioStream", "LiveAvatarAudioConfig", "Wav2Vec2",
           "Wav2Vec2Config", "flashhead_audio_context", "liveavatar_audio_input", "normalize_waveform"]
