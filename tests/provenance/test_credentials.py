"""Content credentials (C2PA) on every output: real c2pa-rs signing and validation, real files.

`generate` (the bundled model, 1 s of speech) writes a file whose manifest c2pa's Reader
validates, with the IPTC trainedAlgorithmicMedia source type and the model; a changed byte fails;
the user's certificate is used when given (and one c2pa refuses is one clear error before any
work); the first-use local certificate is made once and reused; signing keeps our fragmented MP4
frame for frame; a signing failure keeps the complete unsigned video.
"""

from __future__ import annotations

import datetime
import json
import threading
from pathlib import Path

import av
import c2pa
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from avatarstream.errors import ConfigError
from avatarstream.provenance.credentials import (
    GENERATION_LABEL, LOCAL_ORG, TRAINED_ALGORITHMIC_MEDIA, ContentCredentials, credentials_for,
    load_identity, local_identity, local_paths, model_label)
from conftest import run_cli

from .clips import FPS, decoded, top_boxes, write_clip


def manifest(path: Path) -> tuple[str, dict, list[str]]:
    """(validation state, active manifest, failure codes) as c2pa's Reader gives them."""
    with c2pa.Reader(str(path)) as r:
        results = r.get_validation_results()["activeManifest"]
        return (r.get_validation_state(), r.get_active_manifest(),
                [f["code"] for f in results.get("failure", [])])


def assertion(m: dict, label: str) -> dict:
    return next(a["data"] for a in m["assertions"] if a["label"] == label)


def bare_self_signed(folder: Path) -> tuple[Path, Path]:
    """A self-signed leaf with no CA (what c2pa-rs refuses to sign with) and its key."""
    k = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bare")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(k.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=9))
            .sign(k, hashes.SHA256()))
    (folder / "bare.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "bare.key").write_bytes(k.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return folder / "bare.pem", folder / "bare.key"


def test_generate_output_carries_a_valid_ai_generated_manifest(generated):
    out, r = generated  # the session's default bundled-model run (tests/provenance/conftest.py)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert "SELF-SIGNED" in r.stdout and "UNTRUSTED" in r.stdout
    cc = summary["content_credentials"]
    assert cc["signed"] and cc["self_signed"] and cc["error"] is None
    state, m, failures = manifest(out)
    # valid: signature and every hash check out; only the trust list does not know the signer
    assert state == "Valid" and failures == ["signingCredential.untrusted"]
    assert m["claim_generator_info"][0]["name"] == "avatarstream"
    created = assertion(m, "c2pa.actions.v2")["actions"][0]
    assert created["action"] == "c2pa.created"
    assert created["digitalSourceType"] == TRAINED_ALGORITHMIC_MEDIA
    ours = assertion(m, GENERATION_LABEL)
    assert ours["model"] == summary["model"] and ours["synthesised_likeness"] is True
    assert m["signature_info"]["issuer"] == LOCAL_ORG
    assert m["title"] == "talk.mp4"
    assert "moof" in top_boxes(out)  # still the fragmented MP4 the sink wrote
    with av.open(str(out)) as c:
        assert sum(1 for _ in c.decode(video=0)) == summary["frames"] == FPS
    assert sorted(p.name for p in out.parent.iterdir()) == ["ref.png", "speech.wav", "talk.mp4"]


def test_signing_keeps_the_fragmented_file_frame_for_frame(tmp_path):
    """c2pa-rs signs our frag_keyframe+empty_moov MP4 as it is (no remux): the same video and
    audio decode from the signed file (exactly), and a changed byte of the video fails."""
    creds = credentials_for("tiny-random")
    plain, signed = tmp_path / "plain.mp4", tmp_path / "signed.mp4"
    write_clip(plain, seconds=2)
    sink = write_clip(signed, creds, seconds=2)
    assert sink.signed is not None and sink.signed.signed and sink.durable_frames == 2 * FPS
    boxes = top_boxes(signed)
    assert boxes[:3] == ["ftyp", "uuid", "moov"] and boxes.count("moof") == 2
    assert top_boxes(plain) == [b for b in boxes if b != "uuid"]
    for a, b in zip(decoded(plain), decoded(signed), strict=True):
        np.testing.assert_array_equal(a, b)  # tolerance 0: the samples are untouched
    assert manifest(signed)[0] == "Valid"

    data = bytearray(signed.read_bytes())
    data[data.rfind(b"mdat") + 100] ^= 0xFF  # one byte of the last fragment's media
    tampered = tmp_path / "tampered.mp4"
    tampered.write_bytes(bytes(data))
    state, _, failures = manifest(tampered)
    assert state == "Invalid" and "assertion.bmffHash.mismatch" in failures


def test_user_certificate_is_used(generated_unmarked_user_signed, user_cert, monkeypatch):
    cert, key = user_cert
    out, r = generated_unmarked_user_signed  # `generate --sign-cert/--sign-key` (and --no-watermark)
    assert r.returncode == 0, r.stderr
    cc = json.loads(r.stdout.strip().splitlines()[-1])["content_credentials"]
    assert cc["signed"] and not cc["self_signed"] and cc["signer"] == "Example Newsroom signer"
    assert "by Example Newsroom signer" in r.stdout and "SELF-SIGNED" not in r.stdout
    state, m, _ = manifest(out)
    assert state == "Valid" and m["signature_info"]["issuer"] == "Example Newsroom"
    monkeypatch.setenv("AVATARSTREAM_SIGN_CERT", str(cert))  # the environment's, for servers
    monkeypatch.setenv("AVATARSTREAM_SIGN_KEY", str(key))
    assert credentials_for("m1").identity.subject == "Example Newsroom signer"


def test_unusable_user_certificates_are_one_clear_error(tmp_path, user_cert, media):
    cert, key = user_cert
    bare_cert, bare_key = bare_self_signed(tmp_path)  # c2pa-rs refuses it: found before any work
    with pytest.raises(ConfigError, match="c2pa cannot sign with the certificate"):
        credentials_for("m", bare_cert, bare_key)
    with pytest.raises(ConfigError, match="does not belong"):
        credentials_for("m", cert, bare_key)
    with pytest.raises(ConfigError, match="give both"):
        credentials_for("m", cert, None)
    out = tmp_path / "out.mp4"
    r = run_cli("generate", "--reference", str(media["png"]), "--audio", str(media["wav_3s"]),
                "--out", str(out), "--no-progress", "--sign-cert", str(cert),
                "--sign-key", str(tmp_path / "missing.key"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"avatarstream: error: cannot read the signing certificate or key: "
        f"{tmp_path / 'missing.key'}: no such file or directory"]
    assert not out.exists()


def test_first_use_certificate_is_made_once_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("AVATARSTREAM_CONFIG_DIR", str(tmp_path / "cfg"))
    ca, chain, key = local_paths()
    assert ca.parent == tmp_path / "cfg" / "signing" and not chain.exists()
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(local_identity())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({g.chain_pem for g in got}) == 1 and all(g.local for g in got)  # one certificate
    assert key.stat().st_mode & 0o777 == 0o600
    before = chain.read_bytes(), chain.stat().st_mtime_ns
    again = credentials_for("m")
    assert (chain.read_bytes(), chain.stat().st_mtime_ns) == before
    assert again.identity.chain_pem == before[0] and again.identity.local
    leaf, issuer = x509.load_pem_x509_certificates(before[0])
    assert leaf.issuer == issuer.subject and leaf.issuer != leaf.subject  # a local CA + its leaf


def test_a_signing_failure_keeps_the_complete_unsigned_video(tmp_path):
    """A certificate c2pa refuses at signing time (here a bare self-signed leaf, let past the
    probe): the file is still renamed into place, whole and playable, unsigned, and says so."""
    d = tmp_path / "bare"
    d.mkdir()
    creds = ContentCredentials(load_identity(*bare_self_signed(d)), "m")
    out = tmp_path / "out.mp4"
    sink = write_clip(out, creds)
    assert sink.signed is not None and not sink.signed.signed
    assert "NOT signed" in sink.signed.note() and "certificate" in sink.signed.error
    assert c2pa.Reader.try_create(str(out)) is None
    assert decoded(out)[0].shape[0] == FPS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare", "out.mp4"]  # no temp left


def test_the_manifest_names_a_model_never_its_path():
    assert model_label("tiny-random") == "tiny-random"
    assert model_label("/home/me/weights/my-export/") == "my-export"
    assert model_label("liveavatar:/home/me/ckpt/LiveAvatar,context=/home/me/c.st,fp8") == \
        "liveavatar:LiveAvatar"
    assert model_label("flashhead-lite:rel/SoulX-FlashHead-1_3B") == "flashhead-lite:SoulX-FlashHead-1_3B"


def test_what_a_failed_run_keeps_is_signed_too(tmp_path):
    """A run that fails after writing frames keeps them under the partial name (publish/file.py):
    that file is AI-made as much as a finished one, and carries the same valid manifest."""
    from avatarstream.media.frames import AudioChunk, VideoChunk
    from avatarstream.publish.file import FragmentedMP4Sink

    out = tmp_path / "talk.mp4"
    sink = FragmentedMP4Sink(out, atomic=True, credentials=credentials_for("tiny-random"))
    sink.open(64, 64, FPS, 16000)
    frames = np.random.default_rng(0).integers(0, 255, (FPS, 64, 64, 3), dtype=np.uint8)
    sink.write_video(VideoChunk(frames=frames, start_frame=0, fps=FPS))
    sink.write_audio(AudioChunk(samples=np.zeros(16000, np.float32), start_sample=0, sample_rate=16000))
    kept = sink.keep()  # the run failed here
    assert kept is not None and not out.exists()
    (partial,) = tmp_path.glob("talk.partial-*.mp4")
    assert sink.signed is not None and sink.signed.signed
    state, m, _ = manifest(partial)
    assert state == "Valid" and m["title"] == "talk.mp4"
    assert assertion(m, "c2pa.actions.v2")["actions"][0]["digitalSourceType"] == TRAINED_ALGORITHMIC_MEDIA
    assert decoded(partial)[0].shape[0] == FPS
