"""Fixtures shared by the provenance tests: the user's certificate and the `generate` runs whose
files several tests only inspect (a bundled-model run costs a model load plus the generation, so
each kind is made once per session instead of once per test)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from avatarstream.media.image import write_png
from avatarstream.media.synthetic import face_image, speechlike, write_wav
from avatarstream.provenance.credentials import issue_certificate
from conftest import run_cli


@pytest.fixture(scope="session")
def user_cert(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("user-cert")
    issue_certificate(d / "ca.pem", d / "chain.pem", d / "key.pem", organization="Example Newsroom")
    return d / "chain.pem", d / "key.pem"


def _generate(folder: Path, out_name: str, *flags: str) -> tuple[Path, subprocess.CompletedProcess]:
    # 1 s of speech: what is checked (the manifest, the signer, the watermark's detection, which
    # reads every frame and needs far fewer than 25 of them) does not depend on the length
    audio = write_wav(folder / "speech.wav", speechlike(1.0))
    ref = write_png(folder / "ref.png", face_image(128))
    out = folder / out_name
    r = run_cli("generate", "--reference", str(ref), "--audio", str(audio), "--out", str(out),
                "--no-progress", "--json", *flags)
    return out, r


@pytest.fixture(scope="session")
def generated(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The bundled model's `generate` with every default (watermarked, signed with the first-use
    local certificate): (the output file, the finished process). Its folder holds only the inputs
    and the output, so a test can check nothing else was left behind."""
    return _generate(tmp_path_factory.mktemp("generated"), "talk.mp4")


@pytest.fixture(scope="session")
def generated_unmarked_user_signed(tmp_path_factory, user_cert) -> tuple[Path, subprocess.CompletedProcess]:
    """The bundled model's `generate --no-watermark` signed with the user's certificate
    (`--sign-cert/--sign-key`): the two options are independent, so one run serves both claims."""
    cert, key = user_cert
    return _generate(tmp_path_factory.mktemp("generated-unmarked"), "a.mp4", "--no-watermark",
                     "--sign-cert", str(cert), "--sign-key", str(key))
