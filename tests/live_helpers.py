"""A live session spoken to once, as the end-to-end tests of each model family do it."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np


def speak_once(session: Any, samples: np.ndarray, *, wait_s: float = 30.0, timeout_s: float = 60.0) -> list[Any]:
    """Start `session`, push `samples` (float32, its sample rate) after its first idle frame, end
    the speech, stop once `speech_ended` came (or `wait_s` passed); the video items it published
    (each has `.pts` and `.data`), in order."""
    video: list[Any] = []

    async def consume() -> None:
        async for item in session.frames(poll_s=0.05):
            if item.kind == "video":
                video.append(item)

    def drive() -> None:
        while not video:
            time.sleep(0.01)
        session.push_audio(samples)
        session.end_of_speech()
        deadline = time.monotonic() + wait_s
        while not any(e["type"] == "speech_ended" for e in list(session.events)) and time.monotonic() < deadline:
            time.sleep(0.05)
        session.stop()

    session.start()
    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    asyncio.run(asyncio.wait_for(consume(), timeout=timeout_s))
    driver.join(5)
    return video
