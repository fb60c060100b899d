"""LiveKit rooms: an avatar worker that joins rooms on dispatch and speaks there (`avatarstream livekit`).

LiveKit Agents splits a talking avatar in two participants: the agent (STT, LLM, TTS) streams its
TTS audio to the avatar participant over a byte stream, and the avatar publishes the video (and
that audio, in sync) to the room. This package is the avatar side, built on the engine's live
sessions:

- `host.AvatarHost` (no LiveKit import): the worker's one model, one `ChunkScheduler` and one
  admission (`Capacity`), shared by every room, as `avatarstream serve` shares them between its
  sessions; each room is one `LiveSession` on that scheduler. Its `load()` is what the dispatcher
  is told.
- `generator.SessionVideoGenerator`: LiveKit Agents' `VideoGenerator` over one live session
  (audio pushed in, `clear_buffer`, timed video and audio frames out, `AudioSegmentEnd` after the
  last frame of an utterance). LiveKit's `AvatarRunner` publishes what it yields.
- `worker`: the agent server (LiveKit Agents' worker protocol): job requests accepted while
  admission allows, one room per job in this process (jobs run on threads, not processes, so they
  share the model), load reported from admission.
- `agent.AvatarStreamAvatar`: for the agent's side, an `AvatarSession` that dispatches this worker
  into the room and routes the agent's audio to it.

LiveKit's packages are an optional extra: this module and `cli` import without them, and using
the worker without them is one `ConfigError` that says what to install (`require`).
"""

from __future__ import annotations

from avatarstream.errors import ConfigError

EXTRA = "pip install 'avatarstream[livekit]'"


def require() -> None:
    """Raise ConfigError (what to install) unless LiveKit's Python packages are importable."""
    try:
        import livekit.agents  # noqa: F401
        import livekit.api  # noqa: F401
        import livekit.rtc  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"the LiveKit worker needs LiveKit's Python packages ({e.name or e} "
                          f"is missing): {EXTRA}") from None
