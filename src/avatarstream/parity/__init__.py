"""Parity with the official code: `avatarstream models parity FIXTURE`.

A fixture (`avatarstream-parity/1`, described in docs/parity-fixtures.md)
holds, for one official network at a tiny size, random weights under the official keys, every input
the official run consumed and what it produced. `run_parity` loads the weights through the same
loader and key mapping a real checkpoint goes through, runs our implementation on the inputs and
compares. One module per family implements `run(fixture) -> {expected name: tensor}`.
"""

from __future__ import annotations

# family -> module with `run(fx: Fixture) -> dict[str, torch.Tensor]` (None: not yet supported)
FAMILIES: dict[str, str | None] = {
    "wan-vae": "avatarstream.parity.wan_vae",
    "ltx-vae": "avatarstream.parity.ltx_vae",
    "wav2vec2": "avatarstream.parity.wav2vec2",
    "flashhead-dit": "avatarstream.parity.flashhead_dit",
    "liveavatar-dit": "avatarstream.parity.liveavatar_dit",
    "umt5": "avatarstream.parity.umt5",
}
