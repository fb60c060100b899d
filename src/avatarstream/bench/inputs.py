"""The benchmarks' synthetic inputs, kept in `media/synthetic.py` (the server uses them too) and
re-exported here with `write_png` so a benchmark or test imports its inputs from one place."""

from avatarstream.media.image import write_png
from avatarstream.media.synthetic import face_image, speechlike, write_wav

__all__ = ["face_image", "speechlike", "write_png", "write_wav"]
