"""Weights folders: how they are read (`folder`), what a model is before it is built (`spec`),
how a stored format maps onto our networks (`adapters`), and the bundled models themselves
(`avatarstream-small/`, `avatarstream-small-causal/`: data folders beside this code).

The inference side's whole view of trained weights; `train/export.py` writes the folders and
imports its readers from here, never the other way round.
"""

from avatarstream.weights.adapters import NATIVE, KeyRule, StateDictAdapter
from avatarstream.weights.folder import (file_sha256, load_exported, load_weights, model_spec, read_config,
                                         weights_file)
from avatarstream.weights.spec import ModelSpec, pipeline_preset, small_pipeline, tiny_pipeline

__all__ = ["NATIVE", "KeyRule", "ModelSpec", "StateDictAdapter", "file_sha256", "load_exported",
           "load_weights", "model_spec", "pipeline_preset", "read_config", "small_pipeline", "tiny_pipeline",
           "weights_file"]
