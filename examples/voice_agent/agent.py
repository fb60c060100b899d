"""A whole voice conversation with the avatar in the browser, on this machine.

    python examples/voice_agent/agent.py                     # the bundled model; open http://127.0.0.1:7860
    python examples/voice_agent/agent.py --model tiny-random --beep

A small aiohttp server: `/` is the page (index.html: the avatar's video and voice, the
microphone); `/api/offer` takes the page's WebRTC offer and starts one Pipecat pipeline
(bot.py) on a `SmallWebRTCTransport` for it; `/api/state` is what the agent saw and did (turns,
the avatar's listening flag, its frames, markers), for the page and for tests.

The model is loaded once at start (`acquire_host`), and every connection's avatar opens a
session on it, as `avatarstream serve` does.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path

from aiohttp import web

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bot.py next to this file

log = logging.getLogger("voice_agent")


class Agent:
    """The server's state: the shared avatar host and the record of each connection."""

    def __init__(self, host: object, beep: bool) -> None:
        self.host, self.beep = host, beep
        self.records: list[dict] = []  # the current conversation's (one at a time)
        self.avatars: list[object] = []
        self.workers: list[object] = []
        self.watchers: list[asyncio.Task] = []

    async def offer(self, request: web.Request) -> web.Response:
        from pipecat.pipeline.worker import PipelineParams, PipelineWorker
        from pipecat.transports.smallwebrtc.connection import SmallWebRTCConnection
        from pipecat.transports.smallwebrtc.transport import SmallWebRTCTransport

        from avatarstream.integrations.pipecat import AvatarstreamVideoService
        from bot import VIDEO_FPS, build_pipeline, transport_params

        body = await request.json()
        if not isinstance(body, dict) or "sdp" not in body or body.get("type") != "offer":
            raise web.HTTPBadRequest(text="expected a WebRTC offer: {sdp, type: 'offer'}")
        # One conversation at a time (a reloaded page's old peer may not have said goodbye yet):
        # the new one takes over, and the old one's avatar session frees the model's slot.
        for worker in self.workers:
            await worker.cancel()
        self.workers.clear()
        for task in self.watchers:
            task.cancel()
        self.watchers.clear()
        connection = SmallWebRTCConnection()
        await connection.initialize(sdp=body["sdp"], type="offer")
        avatar = AvatarstreamVideoService(host=self.host, video_out_framerate=VIDEO_FPS)
        width, height = self.host.models.config.out_hw[1], self.host.models.config.out_hw[0]
        transport = SmallWebRTCTransport(connection, params=transport_params(width, height))
        record: dict = {"started": time.monotonic()}
        pipeline = build_pipeline(transport, avatar, record, beep=self.beep)
        worker = PipelineWorker(pipeline, params=PipelineParams(enable_metrics=True))

        @transport.event_handler("on_client_disconnected")
        async def _gone(transport: object, client: object) -> None:
            await worker.cancel()

        self.records, self.avatars = [record], [avatar]
        record["stalls"] = []
        worker_task = asyncio.get_running_loop().create_task(self._watch_loop(record["stalls"]))
        self.watchers.append(worker_task)
        self.workers.append(worker)
        asyncio.get_running_loop().create_task(self._run(worker))
        return web.json_response(connection.get_answer())

    @staticmethod
    async def _watch_loop(stalls: list) -> None:
        """Note every time this event loop was held up for more than 40 ms (time, ms): while it
        is, nothing reaches WebRTC, and the browser's audio buffer grows by that much."""
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            late = time.monotonic() - t - 0.01
            if late > 0.04:
                stalls.append((round(t, 3), round(late * 1000)))

    async def _run(self, worker: object) -> None:
        from pipecat.workers.runner import WorkerRunner

        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(worker)
        try:
            await runner.run()
        except Exception:  # noqa: BLE001 - one conversation failing must not stop the server
            log.exception("the conversation's pipeline failed")

    async def state(self, request: web.Request) -> web.Response:
        """The latest conversation: its record plus the avatar's listening flag and counters."""
        if not self.records:
            return web.json_response({"conversation": False})
        record, avatar = self.records[-1], self.avatars[-1]
        now = time.monotonic()
        out = {"now": now,
               "listening": avatar.listening, "frames_out": avatar.frames_out,
               "ttfb_s": avatar.ttfb_s, **record}
        return web.json_response(out)

    async def page(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(HERE / "index.html")

    async def close(self, app: web.Application) -> None:
        for worker in self.workers:
            await worker.cancel()
        self.workers.clear()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a registered model (default: the bundled one)")
    p.add_argument("--avatar", default=None, help="an image or video of the face (default: a drawn face)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--max-sessions", type=int, default=1,
                   help="conversations at once on the model (default 1: no capacity measurement)")
    p.add_argument("--beep", action="store_true",
                   help="start each sentence with a tone and mark its video frame (A/V measurement)")
    p.add_argument("--steps", type=int, default=None, help="override the model's sampling steps")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)

    from avatarstream.errors import AvatarStreamError
    from avatarstream.integrations.local import acquire_host, release_host

    try:
        host = acquire_host(args.model, args.avatar, device=args.device, max_sessions=args.max_sessions)
    except AvatarStreamError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.steps is not None:
        host.models.config.steps = args.steps
    agent = Agent(host, args.beep)
    app = web.Application()
    app.router.add_get("/", agent.page)
    app.router.add_post("/api/offer", agent.offer)
    app.router.add_get("/api/state", agent.state)
    app.on_shutdown.append(agent.close)
    print(f"voice agent on http://{args.host}:{args.port}/ (model {host.models.name})", flush=True)
    try:
        web.run_app(app, host=args.host, port=args.port, print=None)
    finally:
        release_host(host)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
