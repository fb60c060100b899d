"""Provenance: every video avatarstream makes says that it is AI-generated.

- `watermark`: an invisible mark in the pixels of every generated frame (files, HLS, live
  sessions, renders); it survives re-encoding, resizing, cropping and blur (docs/provenance.md).
- `credentials`: C2PA content credentials signed into the files.
- `verify`: reads both (`avatarstream verify FILE|URL`).

Nothing here imports the engine, sessions or server (an import-linter contract): they import it.
"""

NO_WATERMARK_HELP = ("leave out the invisible watermark that marks every frame as AI-generated (on by "
                     "default: it travels with the pixels where no content credential does; see "
                     "docs/provenance.md)")
