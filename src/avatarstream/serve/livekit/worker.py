"""The avatar worker: LiveKit Agents' agent server, one room per job, every room on one AvatarHost.

    server = make_server(host, WorkerSettings(url, api_key, api_secret))
    await server.run()

LiveKit's dispatcher offers the worker a job for a room (explicit dispatch by `agent_name`: the
agent asks for this avatar, `agent.AvatarStreamAvatar`). The request is accepted while admission
allows (`AvatarHost.admit`; refused ones go to another worker), under the identity the dispatch
metadata names, publishing on behalf of the agent. The job joins the room, waits for the agent
(its `sender_identity`, or the first agent participant), receives its audio over LiveKit's byte
stream (`DataStreamAudioReceiver`) into a `SessionVideoGenerator`, and LiveKit's `AvatarRunner`
publishes the avatar's video and audio tracks. The audio is the agent's own at 48 kHz
(`ROOM_AUDIO_RATE`): a track's audio source has one rate, fixed before the agent has sent
anything, and 48 kHz (what WebRTC's Opus codes anyway) loses nothing of any agent's rate. When
the agent leaves (or the session fails), the job ends and its session's slot is free again.

Jobs run on threads of this process (`JobExecutorType.THREAD`), not in job processes as LiveKit
does by default: the model is loaded once and every room's chunks are batched by the one
scheduler. The dispatcher is told `AvatarHost.load()` with a threshold of 1.0 (host.py).

Listening: LiveKit Agents keeps the user's state (speaking / listening / away) in the agent's
`AgentSession` and publishes only the agent's own state to the room, so the avatar participant
cannot see it. `agent.AvatarStreamAvatar` forwards it as an attribute of the agent participant
(`USER_STATE_ATTRIBUTE`); the job follows that attribute (`follow_user_state`): while the user
speaks, the room's session listens (`LiveSession.listen`).

Dispatch metadata (JSON, every key optional): {"sender_identity": the agent's identity,
"avatar_identity": this participant's identity, "avatar_name": its display name}.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from livekit import rtc
from livekit.agents import AgentServer, AutoSubscribe, JobContext, JobExecutorType, JobRequest, utils
from livekit.agents.types import ATTRIBUTE_PUBLISH_ON_BEHALF
from livekit.agents.voice.avatar import AvatarOptions, AvatarRunner, DataStreamAudioReceiver

from avatarstream.serve.livekit.generator import SessionVideoGenerator
from avatarstream.serve.livekit.host import LOAD_THRESHOLD, AvatarHost
from avatarstream.serve.sessions import AdmissionError

log = logging.getLogger(__name__)

AGENT_NAME = "avatarstream"
SENDER_TIMEOUT_S = 60.0  # a dispatched job waits this long for its agent to be in the room
ROOM_AUDIO_RATE = 48000  # the avatar's audio track (WebRTC's Opus codes 48 kHz whatever it is fed)
USER_STATE_ATTRIBUTE = "avatarstream.user_state"  # on the agent participant: its user's state


@dataclass(frozen=True)
class WorkerSettings:
    url: str
    api_key: str
    api_secret: str
    agent_name: str = AGENT_NAME
    http_port: int = 8081  # LiveKit's health check (GET /)


@dataclass(frozen=True)
class DispatchMetadata:
    sender_identity: str | None = None
    avatar_identity: str | None = None
    avatar_name: str = "avatar"

    @classmethod
    def parse(cls, text: str) -> DispatchMetadata:
        """The job's metadata; anything that is not a JSON object counts as empty."""
        try:
            data = json.loads(text) if text else {}
        except ValueError:
            data = {}
        if not isinstance(data, dict):
            data = {}

        def text_of(key: str) -> str | None:
            v = data.get(key)
            return v if isinstance(v, str) and v else None

        return cls(text_of("sender_identity"), text_of("avatar_identity"),
                   text_of("avatar_name") or "avatar")


def follow_user_state(sender_identity: str, session: Any) -> Callable[[dict, Any], None]:
    """A `participant_attributes_changed` handler (changed attributes, participant): the agent's
    `USER_STATE_ATTRIBUTE` turns the session's listening on ("speaking") and off (anything else).
    Call it with the agent's current attributes once when the room starts."""

    def on_changed(changed: dict, participant: Any) -> None:
        state = changed.get(USER_STATE_ATTRIBUTE)
        if getattr(participant, "identity", None) == sender_identity and state is not None:
            session.listen(state == "speaking")

    return on_changed


def make_server(host: AvatarHost, settings: WorkerSettings) -> AgentServer:
    """The agent server for `host` (started: `await server.run()`)."""
    server = AgentServer(
        job_executor_type=JobExecutorType.THREAD, load_fnc=host.load,
        load_threshold=LOAD_THRESHOLD, num_idle_processes=0, ws_url=settings.url,
        api_key=settings.api_key, api_secret=settings.api_secret, port=settings.http_port)

    async def on_request(req: JobRequest) -> None:
        reason = host.admit()
        if reason is not None:
            log.info("room %s refused: %s", req.room.name, reason)
            await req.reject(terminate=False)  # another worker may take it
            return
        meta = DispatchMetadata.parse(req.job.metadata)
        attributes = {ATTRIBUTE_PUBLISH_ON_BEHALF: meta.sender_identity} if meta.sender_identity else None
        await req.accept(name=meta.avatar_name, identity=meta.avatar_identity or "",
                         attributes=attributes)

    async def entrypoint(ctx: JobContext) -> None:
        await run_room(ctx, host)

    server.rtc_session(entrypoint, agent_name=settings.agent_name, on_request=on_request)
    return server


async def run_room(ctx: JobContext, host: AvatarHost) -> None:
    """One room: the avatar speaks what the agent sends it until the agent leaves."""
    meta = DispatchMetadata.parse(ctx.job.metadata)
    await ctx.connect(auto_subscribe=AutoSubscribe.SUBSCRIBE_NONE)
    room = ctx.room
    try:
        sender = await asyncio.wait_for(utils.wait_for_participant(
            room, identity=meta.sender_identity,
            kind=None if meta.sender_identity else rtc.ParticipantKind.PARTICIPANT_KIND_AGENT),
            SENDER_TIMEOUT_S)
    except asyncio.TimeoutError:
        ctx.shutdown(f"no agent ({meta.sender_identity or 'any'}) joined within {SENDER_TIMEOUT_S:g} s")
        return
    try:
        gen = SessionVideoGenerator(host, sample_rate=ROOM_AUDIO_RATE)
    except AdmissionError as e:  # admitted at the request, full by now
        log.warning("room %s: %s", room.name, e)
        ctx.shutdown(str(e))
        return
    c = host.models.config
    runner = AvatarRunner(
        room, audio_recv=DataStreamAudioReceiver(room, sender_identity=sender.identity),
        video_gen=gen, options=AvatarOptions(video_width=c.out_hw[1], video_height=c.out_hw[0],
                                             video_fps=c.fps, audio_sample_rate=ROOM_AUDIO_RATE,
                                             audio_channels=1))
    left = asyncio.Event()

    def on_left(p: rtc.RemoteParticipant) -> None:
        if p.identity == sender.identity:
            left.set()

    room.on("participant_disconnected", on_left)
    user_state = follow_user_state(sender.identity, gen.session)
    user_state(dict(sender.attributes), sender)
    room.on("participant_attributes_changed", user_state)
    room.on("disconnected", lambda *_: left.set())
    try:
        await runner.start()
        while not left.is_set() and gen.session.running:  # or the session failed
            try:
                await asyncio.wait_for(left.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
    finally:
        await runner.aclose()
        await gen.aclose()
        log.info("room %s ended (%d items dropped)", room.name, gen.dropped)
    ctx.shutdown("the agent left" if left.is_set() else
                 f"the avatar's session ended ({gen.session.end_reason})")
