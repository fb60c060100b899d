"""State-dict adapters: how a stored weights format maps onto our networks (torchtitan's habit).

Loading a checkpoint made elsewhere (an official release, an older export of ours) is one named
`StateDictAdapter`, not renames scattered through model code: `config` turns the format's
config.json into today's schema, `state_dict` renames, reshapes or drops the keys of one
network's file. Everything after it (strict loading, placement, the registry) is the same for
every format. Our own `train export` folders go through `NATIVE`, which is where an old
config.json keeps loading as it always did.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from avatarstream.errors import InputError
from avatarstream.models.audio import AudioConfig
from avatarstream.models.dit import DiTConfig
from avatarstream.models.refiner import RefinerConfig
from avatarstream.models.text import TextConfig
from avatarstream.models.vae import VAEConfig

# the five networks of a model (one .safetensors file each) and their config classes
NETWORK_CONFIGS: Mapping[str, type] = {"dit": DiTConfig, "refiner": RefinerConfig, "vae": VAEConfig,
                                       "audio": AudioConfig, "text": TextConfig}


@dataclass(frozen=True)
class KeyRule:
    """Stored keys of network `net` that fully match `pattern` become `key` (a `re` template:
    `\\1` is the first group), with `reshape` applied to the tensor; `key=None`: the tensor has
    no place in our network and is dropped."""

    net: str
    pattern: str
    key: str | None
    reshape: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class StateDictAdapter:
    """A stored format -> our config schema and state dicts. The first rule that matches a key
    decides it; keys no rule matches are already ours."""

    name: str
    rules: tuple[KeyRule, ...] = ()
    upgrade: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # config.json -> today's schema

    def config(self, raw: dict[str, Any]) -> dict[str, Any]:
        return raw if self.upgrade is None else self.upgrade(raw)

    def state_dict(self, net: str, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One network's stored tensors under our keys and shapes; InputError when two stored
        tensors would land on the same key (the rules are wrong for this file)."""
        rules = [(re.compile(r.pattern), r) for r in self.rules if r.net == net]
        out: dict[str, torch.Tensor] = {}
        for stored, value in state.items():
            key: str | None = stored
            for rx, rule in rules:
                m = rx.fullmatch(stored)
                if m is None:
                    continue
                key = None if rule.key is None else m.expand(rule.key)
                if rule.reshape is not None:
                    value = rule.reshape(value)
                break
            if key is None:
                continue
            if key in out:
                raise InputError(f"{self.name} weights: two stored {net} tensors map to {key!r}")
            out[key] = value
        return out


def _native_config(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json of any `train export` version, in today's schema. A network without a stored
    config (exports from before the sizes were stored) gets its size preset's; a stored config
    without a field added since keeps that field's dataclass default (a DiT trained before the
    scene anchor: `anchor = False`), which is the variant its weights are; JSON lists become
    tuples; no "pipeline" or "shared": empty."""
    model = raw["model"]
    stored = raw.get("configs", {})
    configs = {net: {k: tuple(v) if isinstance(v, list) else v for k, v in stored[net].items()}
               if net in stored else dataclasses.asdict(getattr(cls, model)())
               for net, cls in NETWORK_CONFIGS.items()}
    return {**raw, "configs": configs, "pipeline": raw.get("pipeline", {}), "shared": raw.get("shared", {})}


NATIVE = StateDictAdapter("avatarstream", upgrade=_native_config)
