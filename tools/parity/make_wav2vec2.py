"""Regenerate a `wav2vec2` parity fixture (variant `liveavatar` or `flashhead`, from `--like`).

    python tools/parity/make_wav2vec2.py --official CHECKOUT/LiveAvatar \
        --like tests/fixtures/golden/wav2vec2-b.safetensors --out /tmp/wav2vec2-b.safetensors
    python tools/parity/make_wav2vec2.py --official CHECKOUT/SoulX-FlashHead \
        --like tests/fixtures/golden/wav2vec2-flashhead-b.safetensors --out /tmp/w2v-fh-b.safetensors

The network is built from the fixture's `config` (a transformers `Wav2Vec2Config`, SDPA
attention) and its weights drawn by the fixture rule.
- `liveavatar`: a `Wav2Vec2ForCTC` run through LiveAvatar's
  `liveavatar/models/wan/wan_2_2/modules/s2v/audio_encoder.py:AudioEncoder`
  (`extract_audio_feat(return_all_layers=True)`, then `get_audio_embed_bucket_fps(fps=25,
  batch_frames=48, m=0)`), made without its `from_pretrained` constructor; its processor is a
  `Wav2Vec2FeatureExtractor(do_normalize=True)` and `librosa.load` returns the stored waveform.
  The pipeline's last step (`unsqueeze(0).permute(0, 2, 3, 1)` into the DiT's
  `[1, layers, C, frames]`) is applied here, because the pipeline module needs decord and peft.
- `flashhead`: FlashHead's `flash_head/audio_analysis/wav2vec2.py:Wav2Vec2Model` run through
  `FlashHeadPipeline.preprocess_audio` and `flash_head/inference.py:get_audio_embedding`
  (frames [`audio_start_idx`, `audio_end_idx`) of the settings), on a pipeline made without its constructor. Shims: `_flashhead.py`.

The waveform is read from the `--like` fixture (`inputs.waveform`): the recipe of the original
draw (six amplitude-modulated sinusoids plus noise, peak 0.4) was recorded in words only, so it
cannot be drawn again bit for bit from `inputs_seed`.
"""
from __future__ import annotations

import numpy as np
import torch

import _common as C

FAMILIES = ("wav2vec2",)  # the fixture families this script makes
SOURCES = (
    "Alibaba-Quark/LiveAvatar@9c2c38de1715e553127b42c82cb959f756b02595",
    "Soul-AILab/SoulX-FlashHead@12467cef31a9554cd9682a0521e6e87deaef9810",
    "huggingface/transformers@v4.51.3",
)


def hf_keys(state: dict) -> dict:
    """torch's weight-norm parametrization names -> the HF checkpoint names the fixtures keep."""
    out = {}
    for k, v in state.items():
        k = k.replace("parametrizations.weight.original0", "weight_g")
        k = k.replace("parametrizations.weight.original1", "weight_v")
        out[k] = v
    return out


def feature_extractor():
    from transformers import Wav2Vec2FeatureExtractor
    return Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0,
                                    do_normalize=True, return_attention_mask=False)


class Recorder:
    """Wraps a callable and keeps what it returned."""

    def __init__(self, fn):
        self.fn, self.out = fn, None

    def __call__(self, *a, **k):
        self.out = self.fn(*a, **k)
        return self.out

    def __getattr__(self, name):
        return getattr(self.fn, name)


def run_liveavatar(root, config, wave):
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC
    C.skip_package_inits(root, "liveavatar")
    C.stub_module("librosa", load=lambda _path, sr=16000: (wave.numpy(), sr))
    from liveavatar.models.wan.wan_2_2.modules.s2v import audio_encoder as ae

    model = Wav2Vec2ForCTC(Wav2Vec2Config.from_dict(config, attn_implementation="sdpa")).eval()
    enc = ae.AudioEncoder.__new__(ae.AudioEncoder)
    enc.processor, enc.model, enc.video_rate = Recorder(feature_extractor()), Recorder(model), 30
    return model, enc


def main():
    args = C.parser(__doc__).parse_args()
    meta, config, settings, like = C.read_fixture(args.like)
    variant = settings["variant"]
    marker = {"liveavatar": "liveavatar/models/wan/wan_2_2/modules/s2v/audio_encoder.py",
              "flashhead": "flash_head/audio_analysis/wav2vec2.py"}[variant]
    root = C.check_checkout(args.official, marker)
    C.cpu_fp32()
    wave = like["inputs.waveform"].clone()
    init = settings["weight_init"]

    with torch.no_grad():
        if variant == "liveavatar":
            model, enc = run_liveavatar(root, config, wave)
            C.draw_weights(model, init["weights_seed"])
            feats = enc.extract_audio_feat("stored-waveform", return_all_layers=True)
            # the -a file states fps 25 and batch_frames 48 in its `bucketing` text only
            bucket, _num_repeat = enc.get_audio_embed_bucket_fps(
                feats, fps=settings.get("fps", 25), batch_frames=settings.get("batch_frames", 48), m=0)
            expected = {
                "input_values": enc.processor.out.input_values[0],
                "hidden_states": torch.cat(enc.model.out.hidden_states),
                "features_30fps": feats,
                "audio_embed": bucket.unsqueeze(0).permute(0, 2, 3, 1),
            }
        else:
            import _flashhead as FH
            from transformers import Wav2Vec2Config
            _m, pipe_mod, inf_mod = FH.import_flashhead(root)
            from flash_head.audio_analysis.wav2vec2 import Wav2Vec2Model
            model = Wav2Vec2Model(Wav2Vec2Config.from_dict(config, attn_implementation="sdpa"))
            model = model.eval()
            C.draw_weights(model, init["weights_seed"])
            pipe = FH.bare_pipeline(pipe_mod)
            pipe.audio_encoder = Recorder(model)
            pipe.wav2vec_feature_extractor = Recorder(feature_extractor())
            audio_emb = pipe.preprocess_audio(wave.numpy(), sr=16000, fps=settings["fps"])
            embedding = inf_mod.get_audio_embedding(  # -a: the last frames (stream mode); -b: all
                pipe, wave.numpy(), audio_start_idx=settings["audio_start_idx"],
                audio_end_idx=settings["audio_end_idx"])
            expected = {
                "input_values": torch.from_numpy(
                    np.squeeze(pipe.wav2vec_feature_extractor.out.input_values)).float(),
                "hidden_states": torch.cat(pipe.audio_encoder.out.hidden_states),
                "audio_emb": audio_emb,
                "audio_embedding": embedding,
            }
    report = C.write_and_compare(args.out, meta, like, hf_keys(model.state_dict()),
                                 {"waveform": wave}, expected)
    report["inputs_from_like"] = ["inputs.waveform"]
    C.finish(report)


if __name__ == "__main__":
    main()
