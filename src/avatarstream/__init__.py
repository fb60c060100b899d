"""avatarstream: streaming audio-driven avatar video generation."""

__version__ = "0.1.0"
