"""The chunk loop (`Pipeline.run` over `ChunkLoop` and `LocalExecutor`) with mock models:
frames follow the audio across chunk boundaries, rolling state stays bounded, back-pressure,
pacing, live sources, the overlapped decode."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from avatarstream.engine.clock import MediaClock
from avatarstream.engine.pipeline import Pipeline

from .mock_models import SR, ListSink, audio_chunks, expected_pixels, mock_models, reference


@pytest.mark.parametrize("strategy", ["prefix", "interp"])
@pytest.mark.parametrize("seconds", [0.05, 1.0, 3.37, 7.0])
def test_frames_follow_audio_across_chunk_boundaries(strategy, seconds):
    sink = ListSink()
    summary = Pipeline(mock_models(strategy)).run(reference(), audio_chunks(seconds), [sink])
    n = MediaClock().frames_for_samples(int(round(seconds * SR)))
    starts = [c.start_frame for c in sink.video]
    frames = np.concatenate([c.frames for c in sink.video])
    assert summary.frames == n == frames.shape[0]
    assert starts == list(np.cumsum([0] + [c.frames.shape[0] for c in sink.video[:-1]]))
    got = frames[:, 0, 0, 0].astype(np.float64)
    assert np.abs(got - expected_pixels(n)).max() <= 1.0  # uint8 rounding only
    assert sink.audio_samples == int(round(seconds * SR))


def test_prefix_appearance_anchor_joins_reference_after_first_chunk():
    models = mock_models("prefix")
    Pipeline(models).run(reference(), audio_chunks(3.0), [ListSink()])
    seen = models.dit.model.ref_frames_seen
    steps = models.config.steps
    assert set(seen[:steps]) == {1} and set(seen[steps:]) == {2}


def test_rolling_state_does_not_grow_with_duration():
    sizes = {}
    for seconds in (12.0, 40.0):
        summary = Pipeline(mock_models("interp")).run(reference(), audio_chunks(seconds), [ListSink()])
        sizes[seconds] = summary.rolling_state_bytes
    assert sizes[12.0] == sizes[40.0] > 0


def test_back_pressure_bounds_frames_in_flight():
    generated = []
    sink = ListSink(delay=0.03)
    lags = []
    orig = sink.write_video

    def write(chunk):  # noqa: ANN001
        lags.append(generated[-1] - chunk.start_frame if generated else 0)
        orig(chunk)

    sink.write_video = write
    Pipeline(mock_models(chunk=3)).run(reference(), audio_chunks(6.0), [sink],
                                       progress=lambda done, total, t: generated.append(done))
    # The publisher queue holds at most 4 items (video or audio): generation may run ahead of the
    # slow sink by a handful of chunks, never by the whole video.
    assert max(lags) <= 6 * 12


def test_pacing_against_media_clock():
    t0 = time.perf_counter()
    Pipeline(mock_models()).run(reference(), audio_chunks(1.6), [ListSink()], max_lead_s=0.2)
    assert time.perf_counter() - t0 >= 1.6 - 0.2 - 0.5  # the first chunk arrives ahead of pacing


def test_live_source_publishes_before_audio_ends():
    """Audio arriving in real time: frames are published while speech is still coming in."""
    first_frame_at, audio_done_at = [], []
    sink = ListSink()
    orig = sink.write_video
    sink.write_video = lambda c: (first_frame_at.append(time.perf_counter()), orig(c))

    def live():
        for piece in torch.zeros(int(2.0 * SR)).split(1600):  # 0.1 s pieces every 0.05 s
            time.sleep(0.05)
            yield piece
        audio_done_at.append(time.perf_counter())

    Pipeline(mock_models(chunk=3)).run(reference(), live(), [sink])
    assert first_frame_at[0] < audio_done_at[0] - 0.3


def test_empty_audio_is_a_user_error():
    from avatarstream.errors import InputError

    with pytest.raises(InputError, match="empty"):
        Pipeline(mock_models()).run(reference(), iter([]), [ListSink()])


def test_threads_do_not_leak():
    before = threading.active_count()
    Pipeline(mock_models()).run(reference(), audio_chunks(1.0), [ListSink()])
    assert threading.active_count() == before


@pytest.mark.parametrize("strategy", ["prefix", "interp", "causal"])
def test_overlapped_decode_is_bit_identical(strategy, one_thread, monkeypatch):
    """Decode on its own thread (`decode_overlap`, the default), or in two parts on two threads
    (`split_decode`), vs inline: the same frames, bit for bit (tolerance 0: the same ops on the
    same data in the same order), the same frame count."""
    import dataclasses

    from avatarstream.registry import load_model

    models = load_model("tiny-random")
    ref = reference()
    got = {}
    for overlap, split in ((False, "0"), (True, "0"), (True, "1")):
        monkeypatch.setenv("AVATARSTREAM_SPLIT_DECODE", split)
        cfg = dataclasses.replace(models.config, strategy=strategy, decode_overlap=overlap)
        sink = ListSink()
        summary = Pipeline(models, cfg).run(ref, audio_chunks(3.3), [sink])
        got[overlap, split] = (summary.frames, [c.start_frame for c in sink.video],
                               np.concatenate([c.frames for c in sink.video]))
    inline = got[False, "0"]
    for key in ((True, "0"), (True, "1")):
        assert got[key][0] == inline[0] == got[key][2].shape[0]
        assert got[key][1] == inline[1]
        assert np.array_equal(got[key][2], inline[2])


def test_overlapped_decode_error_reaches_the_caller():
    models = mock_models()

    def broken(z, cache):  # noqa: ANN001
        raise RuntimeError("decoder exploded")

    models.vae.model.decode_step = broken
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="decoder exploded"):
        Pipeline(models).run(reference(), audio_chunks(3.0), [ListSink()])
    assert threading.active_count() == before


