"""Real footage -> training shards (`avatarstream curate`, issue 32): Ray Data stages that
normalise videos, cut shots (PySceneDetect), track faces (dlib), crop heads, filter stretches with
a reason for each rejection, group identities, group shots into scenes by their background and
pair across scenes. Layout in `pipeline.py`; the optional `curate` and `real` extras hold what it
needs. Nothing on the inference path imports it.
"""

from avatarstream.data.curate.filters import Thresholds
from avatarstream.data.curate.pipeline import CurateConfig, curate
from avatarstream.data.curate.stretch import StretchOptions

__all__ = ["CurateConfig", "StretchOptions", "Thresholds", "curate"]
