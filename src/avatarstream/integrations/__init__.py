"""avatarstream inside other agent stacks: the avatar as a building block of someone else's pipeline.

- `pipecat.AvatarstreamVideoService`: a Pipecat frame processor (extra `pipecat`) that turns the
  agent's TTS audio into the avatar's video frames and the same speech, in step.
- `local`: what an in-process integration shares with `avatarstream serve` and the LiveKit worker
  (one `AvatarHost` per model and face in the process; one live session's timed output).

The layer rule (pyproject.toml, import-linter): integrations sit on top. They may import the
engine, live sessions, the registry and the server's pieces; nothing else in avatarstream imports
them, so no agent framework is ever needed to run the engine or the server.
"""
