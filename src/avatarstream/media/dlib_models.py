"""dlib's pretrained face models (the `real` extra), loaded once for whoever reads real faces.

The real-face metrics (`eval/real.py`) and footage curation (`data/curate/faces.py`) use the same
three models: the HOG frontal face detector, the 68-point landmark predictor (iBUG 300-W layout)
and the 128-d ResNet face descriptor, whose .dat files ship in face-recognition-models.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from avatarstream.errors import ConfigError

LANDMARKS_FILE = "shape_predictor_68_face_landmarks.dat"
DESCRIPTOR_FILE = "dlib_face_recognition_resnet_model_v1.dat"


def models_dir(install_hint: str) -> Path:
    """Folder of the .dat model files of the face-recognition-models package (found without
    importing it: its __init__ needs pkg_resources, which current setuptools no longer ships)."""
    spec = importlib.util.find_spec("face_recognition_models")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"dlib's face models are missing (face-recognition-models): {install_hint}")
    return Path(list(spec.submodule_search_locations)[0]) / "models"


@dataclass(frozen=True)
class DlibModels:
    dlib: Any
    detector: Any
    predictor: Any
    encoder: Any


def load_dlib(model_dir: str | Path | None, install_hint: str) -> DlibModels:
    """Import dlib and read the models from `model_dir` (default: face-recognition-models');
    ConfigError naming `install_hint` when either is missing."""
    try:
        import dlib
    except ImportError as e:
        raise ConfigError(f"reading real faces needs dlib: {install_hint}") from e
    d = Path(model_dir) if model_dir is not None else models_dir(install_hint)
    for name in (LANDMARKS_FILE, DESCRIPTOR_FILE):
        if not (d / name).is_file():
            raise ConfigError(f"dlib model {name} not found in {d}: {install_hint}")
    return DlibModels(dlib, dlib.get_frontal_face_detector(), dlib.shape_predictor(str(d / LANDMARKS_FILE)),
                      dlib.face_recognition_model_v1(str(d / DESCRIPTOR_FILE)))
