"""AvatarStreamAvatar: the agent's side, an `AvatarSession` that brings our avatar into its room.

    avatar = AvatarStreamAvatar()                  # LIVEKIT_URL / _API_KEY / _API_SECRET
    await avatar.start(session, room=ctx.room)     # before session.start(...)

`start` asks LiveKit's dispatcher for an `avatarstream livekit` worker (explicit dispatch by agent
name, the metadata naming the agent as the sender and the avatar's identity) and routes the
agent session's audio output to that participant over LiveKit's byte stream
(`DataStreamAudioOutput`, waiting for the avatar's video track), resampled to the model's
rate on the agent's side. Interrupts (`clear_buffer`) and playback notices travel by RPC, as
LiveKit Agents defines them. The agent session's user state (the user speaking or not), which
LiveKit keeps inside the agent, is forwarded as an attribute of the agent participant
(`forward_user_state`), so the avatar listens while the user speaks.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

from livekit import api, rtc
from livekit.agents.voice.avatar import AvatarSession, DataStreamAudioOutput

from avatarstream.serve.livekit.worker import AGENT_NAME, USER_STATE_ATTRIBUTE

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from livekit.agents.voice import AgentSession


class AvatarStreamAvatar(AvatarSession):
    def __init__(self, *, agent_name: str = AGENT_NAME, avatar_identity: str = "avatarstream-avatar",
                 avatar_name: str = "avatar", sample_rate: int | None = None,
                 api_url: str | None = None, api_key: str | None = None,
                 api_secret: str | None = None) -> None:
        super().__init__()
        self.agent_name, self._identity, self.avatar_name = agent_name, avatar_identity, avatar_name
        self.sample_rate = sample_rate
        self._api = (api_url, api_key, api_secret)

    @property
    def avatar_identity(self) -> str:
        return self._identity

    @property
    def provider(self) -> str:
        return "avatarstream"

    async def start(self, agent_session: AgentSession, room: rtc.Room) -> None:
        await super().start(agent_session, room)
        metadata = json.dumps({"sender_identity": room.local_participant.identity,
                               "avatar_identity": self._identity, "avatar_name": self.avatar_name})
        url, key, secret = self._api
        async with api.LiveKitAPI(url, key, secret) as lk:
            await lk.agent_dispatch.create_dispatch(api.CreateAgentDispatchRequest(
                agent_name=self.agent_name, room=room.name, metadata=metadata))
        agent_session.output.audio = DataStreamAudioOutput(
            room, destination_identity=self._identity, sample_rate=self.sample_rate,
            wait_remote_track=rtc.TrackKind.KIND_VIDEO)
        forward_user_state(agent_session, room.local_participant)


def forward_user_state(agent_session: Any, participant: Any) -> None:
    """Publish the agent session's user state (`user_state_changed`: speaking / listening /
    away) as `USER_STATE_ATTRIBUTE` of the agent's participant, now and at every change; the
    avatar worker follows it (worker.follow_user_state). The latest change wins."""
    tasks: set[asyncio.Task] = set()

    def publish(state: str) -> None:
        async def put() -> None:
            try:
                await participant.set_attributes({USER_STATE_ATTRIBUTE: state})
            except Exception as e:  # noqa: BLE001 - the room went away: nothing to tell
                log.debug("user state not forwarded: %s", e)

        for t in tasks:
            t.cancel()
        task = asyncio.ensure_future(put())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    publish(agent_session.user_state)
    agent_session.on("user_state_changed", lambda ev: publish(ev.new_state))
