"""The listening state: the `listening` WebSocket message on a real server app (tiny-random), and
the LiveKit side (the agent forwards its session's user state, the avatar worker follows it).

While the user speaks the avatar shows the idle frames (the reference, mouth closed, small
motion; no model call, silent audio) and the session does not time out; the message comes back
as an event to every socket of the session; queued speech still plays (cutting it is
`clear_buffer`)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from avatarstream.media.frames import AudioChunk, VideoChunk
from avatarstream.serve.common import SESSIONS

from .helpers import A, _app, _avatar, _pcm, _run

pytestmark = pytest.mark.usefixtures("one_thread")


class Recorder:
    """A session sink that keeps what the session publishes (video frames and audio samples)."""

    durable_frames = 0

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.video: list[tuple[int, np.ndarray]] = []
        self.audio: list[tuple[int, np.ndarray]] = []

    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None:
        pass

    def write_video(self, chunk: VideoChunk) -> None:
        with self.lock:
            self.video += [(chunk.start_frame + i, f) for i, f in enumerate(chunk.frames)]

    def write_audio(self, chunk: AudioChunk) -> None:
        with self.lock:
            self.audio.append((chunk.start_sample, chunk.samples))

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def between(self, f0: int, f1: int, spf: int) -> tuple[list[np.ndarray], float]:
        """The frames [f0, f1) and the peak of the audio published for them."""
        with self.lock:
            frames = [f for i, f in self.video if f0 <= i < f1]
            peak = max([float(np.abs(x[max(0, f0 * spf - s) : max(0, f1 * spf - s)]).max(initial=0))
                        for s, x in self.audio], default=0.0)
        return frames, peak


async def _events(ws, kind: str, timeout: float = 10.0) -> dict:  # type: ignore[no-untyped-def]
    while True:
        msg = await ws.receive_json(timeout=timeout)
        if msg["type"] == kind:
            return msg


def test_listening_message_puts_the_session_in_the_listening_state_and_back(tmp_path):
    app, c = _app(tmp_path)
    spf = c.sample_rate // c.fps

    async def body(client):  # type: ignore[no-untyped-def]
        avatar = await _avatar(client)
        s = await (await client.post("/v1/sessions", json={"avatar_id": avatar}, headers=A)).json()
        sid = s["session_id"]
        session = app[SESSIONS].entries[sid].session
        rec = Recorder()
        session.add_sink(rec)
        ws, other = await client.ws_connect(s["audio_url"]), await client.ws_connect(s["audio_url"])

        await ws.send_json({"type": "listening", "on": True})
        ev = await _events(ws, "listening")
        assert ev["on"] is True and ev["media_s"] >= 0
        assert (await _events(other, "listening"))["on"] is True  # every socket of the session
        st = await (await client.get(f"/v1/sessions/{sid}", headers=A)).json()
        assert st["state"] == "listening" and session.listening
        f0 = session.frame
        await asyncio.sleep(1.0)
        frames, peak = rec.between(f0 + 1, session.frame, spf)
        # alive: idle frames keep coming at the media clock and move; silent; no model call
        assert len(frames) >= 0.7 * c.fps and session.segments == 0 and peak == 0.0
        # not frozen: the drawn face drifts a fraction of a pixel per frame, so most frames
        # differ from the one before, and over the second the picture visibly moves
        distinct = sum(not np.array_equal(a, b) for a, b in zip(frames, frames[1:]))
        assert distinct >= 0.8 * (len(frames) - 1), distinct
        assert np.abs(frames[-1].astype(np.int16) - frames[0]).mean() > 0.05

        # queued speech still plays while the user speaks (interrupting is clear_buffer's job)
        await ws.send_bytes(_pcm(0.5 * np.sin(np.arange(8000) * 2 * np.pi * 220 / c.sample_rate)))
        await ws.send_json({"type": "end_of_speech"})
        started = await _events(ws, "speech_started")
        assert started["segment"] == 1
        await _events(ws, "speech_ended", timeout=20)

        await ws.send_json({"type": "listening", "on": False})
        assert (await _events(ws, "listening"))["on"] is False
        st = await (await client.get(f"/v1/sessions/{sid}", headers=A)).json()
        assert st["state"] == "idle" and not session.listening
        await ws.send_json({"type": "listening"})  # `on` defaults to true: the user speaks
        assert (await _events(ws, "listening"))["on"] is True

        await ws.send_json({"type": "listening", "on": "yes"})
        err = await _events(ws, "error")
        assert '"on": true | false' in err["error"]
        await ws.send_json({"type": "nonsense"})
        assert '"listening"' in (await _events(ws, "error"))["error"]
        await ws.close()
        await other.close()

    _run(app, body)


def test_a_listening_session_does_not_time_out():
    """The user talking for longer than the idle timeout is no idle session; when they stop, the
    timeout counts again."""
    import time

    import torch

    from avatarstream.live.session import LiveSession, LiveSessionConfig
    from avatarstream.registry import load_model

    models = load_model("tiny-random")
    ref = torch.randint(0, 255, (1, 3, *models.config.out_hw), dtype=torch.uint8)
    s = LiveSession(models, ref, config=LiveSessionConfig(idle_timeout_s=0.6, lead_s=0.1))
    s.start()
    try:
        s.listen(True)
        time.sleep(1.5)
        assert s.running, "timed out while the user was speaking"
        s.listen(False)
        assert s.wait_ended(5.0) and s.end_reason == "idle_timeout"
        kinds = [(e["type"], e.get("on")) for e in s.events if e["type"] == "listening"]
        assert kinds == [("listening", True), ("listening", False)]
    finally:
        s.stop()


def test_livekit_agent_forwards_its_user_state_and_the_worker_follows_it():
    """LiveKit keeps the user's state inside the agent's AgentSession (the avatar participant
    never sees it): the agent side publishes it as an attribute of its participant, the avatar
    worker turns the room session's listening on and off from that attribute."""
    pytest.importorskip("livekit.agents", reason="the livekit extra is not installed")
    import torch
    from livekit.agents.voice import AgentSession
    from livekit.agents.voice.events import UserStateChangedEvent

    from avatarstream.live.session import LiveSession, LiveSessionConfig
    from avatarstream.registry import load_model
    from avatarstream.serve.livekit.agent import forward_user_state
    from avatarstream.serve.livekit.worker import USER_STATE_ATTRIBUTE, follow_user_state

    class Participant:  # what the agent's local participant is to the forwarder
        identity = "agent-1"

        def __init__(self) -> None:
            self.attributes: dict[str, str] = {}

        async def set_attributes(self, attributes: dict[str, str]) -> None:
            await asyncio.sleep(0.01)  # a round trip to the room
            self.attributes.update(attributes)

    agent = Participant()

    async def agent_side() -> list[str]:
        session = AgentSession()
        forward_user_state(session, agent)
        seen = []
        await asyncio.sleep(0.05)
        seen.append(agent.attributes[USER_STATE_ATTRIBUTE])  # the state at start
        for old, new in [("listening", "speaking"), ("speaking", "listening"), ("listening", "away")]:
            session.emit("user_state_changed", UserStateChangedEvent(old_state=old, new_state=new))
            await asyncio.sleep(0.05)
            seen.append(agent.attributes[USER_STATE_ATTRIBUTE])
        return seen

    assert asyncio.run(agent_side()) == ["listening", "speaking", "listening", "away"]

    models = load_model("tiny-random")
    ref = torch.randint(0, 255, (1, 3, *models.config.out_hw), dtype=torch.uint8)
    live = LiveSession(models, ref, config=LiveSessionConfig(lead_s=0.1))
    live.start()
    try:
        on_changed = follow_user_state("agent-1", live)
        other = type("P", (), {"identity": "someone-else"})()
        on_changed({USER_STATE_ATTRIBUTE: "speaking"}, other)  # not the agent: ignored
        on_changed({"unrelated": "x"}, agent)
        assert not live.listening
        on_changed({USER_STATE_ATTRIBUTE: "speaking"}, agent)
        assert live.listening
        on_changed({USER_STATE_ATTRIBUTE: "away"}, agent)
        assert not live.listening
        assert [e["on"] for e in live.events if e["type"] == "listening"] == [True, False]
    finally:
        live.stop()
