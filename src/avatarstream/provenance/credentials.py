"""Content credentials (C2PA): a signed manifest in every MP4 we write, saying what made it.

What the manifest says
----------------------
Built with the maintained c2pa-rs bindings (`c2pa-python`). The claim generator is avatarstream
and its version; one `c2pa.created` action with the IPTC digital source type
`trainedAlgorithmicMedia` (what C2PA viewers show as "AI-generated"); and our assertion
`org.avatarstream.generation`: the model that made the video (its registered name, or a weights
folder's own name: never a path) and that the person's likeness in it was synthesised (the
person did not perform it). c2pa-rs adds the hard binding: a BMFF hash
of the whole file, so changing any byte of the video or the manifest fails validation.

Our fragmented MP4 is signed as it is
-------------------------------------
c2pa-rs 0.91 (c2pa-python 0.38) signs and validates the file sink's fragmented MP4
(`frag_keyframe+empty_moov`): it inserts its `uuid` box after `ftyp` and hashes the rest
(`c2pa.hash.bmff.v3`); the signed file keeps its fragments (players and `durable_frames`
readers see the same video; measured in tests/provenance). No remux is needed. Signing reads the
whole file and writes a signed copy (about 1 s per 50 MB on this 2-core machine), so it runs
once, when the file is complete: `sign_in_place` writes the copy beside the file
(`<stem>.signing-<pid>.mp4`), syncs it and renames it over the file. A failed signing (a full
disk, a certificate c2pa refuses) deletes the copy and leaves the complete unsigned video where it
was; the outcome (`Signed`) says so. The file sink holds Ctrl-C and SIGTERM while it signs and
renames (publish/interrupt.py: c2pa reads through Python callbacks, which must not be interrupted);
a copy left by kill -9 is deleted by the next run of the same output (publish/output.py).
HLS output is MPEG-TS, which C2PA does not cover: it carries the invisible watermark only.

Which certificate
-----------------
The user's (`--sign-cert`/`--sign-key`, or AVATARSTREAM_SIGN_CERT/AVATARSTREAM_SIGN_KEY): a PEM
chain (signer first) and its unencrypted PEM key; ES256/384/512, PS256 or Ed25519 by the key's
type. It is tried once on a tiny WAV before any work, so a certificate c2pa refuses is one clear
error, not an unsigned video an hour later. Without one, a local certificate made on first use
(cryptography): c2pa-rs refuses a bare self-signed leaf ("the certificate is invalid"), so it is a
local CA plus a signing leaf (digitalSignature, emailProtection EKU), both named
"avatarstream (self-signed, untrusted)" and kept under the config folder
(AVATARSTREAM_CONFIG_DIR, else $XDG_CONFIG_HOME/avatarstream, else ~/.config/avatarstream) in
`signing/`, key mode 0600, created once under a file lock and reused. No host or user name goes
into it: every video carries the certificate. Verifiers report it as untrusted (it chains to no
C2PA trust list); the summary and `avatarstream verify` say so in words.
"""

from __future__ import annotations

import datetime
import fcntl
import io
import logging
import os
import stat
import time
import wave
from dataclasses import dataclass, replace
from pathlib import Path

import c2pa
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from avatarstream import __version__
from avatarstream.errors import ConfigError

log = logging.getLogger(__name__)

TRAINED_ALGORITHMIC_MEDIA = "http://cv.iptc.org/newscodes/digitalsourcetype/trainedAlgorithmicMedia"
GENERATION_LABEL = "org.avatarstream.generation"
LOCAL_ORG = "avatarstream (self-signed, untrusted)"  # the issuer name verifiers show for ours
MIME = "video/mp4"
# tests only: seconds signing waits with the signed copy written, before the rename (a window in
# which a test's signal is sure to come during signing); unset in any real run
PAUSE_FOR_TESTS = "AVATARSTREAM_TEST_SIGNING_PAUSE_S"
_CA_DAYS, _LEAF_DAYS = 20 * 365, 10 * 365  # no timestamp authority: the leaf must outlive the files


def config_dir() -> Path:
    """Where avatarstream keeps per-user state (the local signing certificate)."""
    if os.environ.get("AVATARSTREAM_CONFIG_DIR"):
        return Path(os.environ["AVATARSTREAM_CONFIG_DIR"])
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "avatarstream"


def local_paths(folder: Path | None = None) -> tuple[Path, Path, Path]:
    """(CA certificate, signer chain, signer key) of the local certificate."""
    d = (folder or config_dir()) / "signing"
    return d / "local-ca.pem", d / "local-signer.pem", d / "local-signer.key"


@dataclass(frozen=True)
class SigningIdentity:
    """A certificate chain (signer first) and its key, ready for c2pa."""

    chain_pem: bytes
    key_pem: bytes
    alg: c2pa.C2paSigningAlg
    subject: str  # the signer's common name
    certificate: Path  # where the chain came from
    local: bool  # the first-use self-signed certificate

    def signer(self) -> c2pa.Signer:
        return c2pa.Signer.from_info(c2pa.C2paSignerInfo(self.alg, self.chain_pem, self.key_pem, None))


def _why(e: Exception) -> str:
    """An OS error in the OS's words ("no space left on device"), anything else as it says."""
    strerror = getattr(e, "strerror", None)
    return strerror.lower() if strerror else str(e)


def _alg(key: object) -> c2pa.C2paSigningAlg:
    if isinstance(key, ec.EllipticCurvePrivateKey):
        by_curve = {"secp256r1": c2pa.C2paSigningAlg.ES256, "secp384r1": c2pa.C2paSigningAlg.ES384,
                    "secp521r1": c2pa.C2paSigningAlg.ES512}
        if key.curve.name in by_curve:
            return by_curve[key.curve.name]
    elif isinstance(key, rsa.RSAPrivateKey):
        return c2pa.C2paSigningAlg.PS256
    elif isinstance(key, ed25519.Ed25519PrivateKey):
        return c2pa.C2paSigningAlg.ED25519
    raise ConfigError("the signing key must be EC P-256/384/521, RSA or Ed25519 (what C2PA signs with)")


def _common_name(cert: x509.Certificate) -> str:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else cert.subject.rfc4514_string()


def load_identity(cert: str | Path, key: str | Path, *, local: bool = False) -> SigningIdentity:
    """The identity in two PEM files; ConfigError naming the file when one is unusable."""
    cert, key = Path(cert), Path(key)
    try:
        chain_pem, key_pem = cert.read_bytes(), key.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read the signing certificate or key: {e.filename}: "
                          f"{_why(e)}") from e
    try:
        chain = x509.load_pem_x509_certificates(chain_pem)
    except ValueError as e:
        raise ConfigError(f"{cert} is not a PEM certificate chain (signer first): {e}") from e
    try:
        private = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError as e:
        raise ConfigError(f"{key} is encrypted; give the key unencrypted (PEM), kept readable by "
                          "you only") from e
    except ValueError as e:
        raise ConfigError(f"{key} is not a PEM private key: {e}") from e
    if chain[0].public_key() != private.public_key():
        raise ConfigError(f"the key {key} does not belong to the first certificate of {cert}")
    now = datetime.datetime.now(datetime.timezone.utc)
    if not chain[0].not_valid_before_utc <= now <= chain[0].not_valid_after_utc:
        raise ConfigError(f"the certificate {cert} is not valid now (valid "
                          f"{chain[0].not_valid_before_utc:%Y-%m-%d} to {chain[0].not_valid_after_utc:%Y-%m-%d})")
    return SigningIdentity(chain_pem, key_pem, _alg(private), _common_name(chain[0]), cert, local)


def _name(common: str, organization: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization)])


def _key_usage(*, sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=sign, content_commitment=False, key_encipherment=False,
                         data_encipherment=False, key_agreement=False, key_cert_sign=not sign,
                         crl_sign=not sign, encipher_only=False, decipher_only=False)


def issue_certificate(ca_path: Path, chain_path: Path, key_path: Path, *,
                      organization: str = LOCAL_ORG) -> None:
    """Write a new CA and a signing leaf it issued (c2pa-rs refuses a bare self-signed leaf):
    the CA certificate, the chain (leaf first) and the leaf's key (mode 0600)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    start = now - datetime.timedelta(minutes=5)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"{organization} CA", organization)
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(now + datetime.timedelta(days=_CA_DAYS))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(_key_usage(sign=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    leaf = (x509.CertificateBuilder().subject_name(_name(f"{organization} signer", organization))
            .issuer_name(ca_name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(now + datetime.timedelta(days=_LEAF_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(sign=True), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.EMAIL_PROTECTION]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    key_bytes = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    _write_new(key_path, key_bytes, 0o600)  # the key first: a chain without its key is never seen
    _write_new(ca_path, ca.public_bytes(pem), 0o644)
    _write_new(chain_path, leaf.public_bytes(pem) + ca.public_bytes(pem), 0o644)


def _write_new(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def local_identity(folder: Path | None = None) -> SigningIdentity:
    """The local self-signed certificate: made on first use (one process makes it, under a lock),
    then reused; made anew only when it has expired."""
    ca, chain, key = local_paths(folder)
    try:
        chain.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(chain.parent / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (chain.is_file() and key.is_file() and _valid_now(chain)):
                log.info("creating the local self-signed signing certificate %s", chain)
                issue_certificate(ca, chain, key)
    except OSError as e:
        raise ConfigError(f"cannot create the local signing certificate in {chain.parent}: "
                          f"{_why(e)}; set AVATARSTREAM_CONFIG_DIR "
                          "to a writable folder or give --sign-cert/--sign-key") from e
    return load_identity(chain, key, local=True)


def _valid_now(chain: Path) -> bool:
    try:
        leaf = x509.load_pem_x509_certificates(chain.read_bytes())[0]
    except (OSError, ValueError):
        return False
    now = datetime.datetime.now(datetime.timezone.utc)
    return leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc - datetime.timedelta(days=1)


def signing_identity(cert: str | Path | None = None, key: str | Path | None = None) -> SigningIdentity:
    """The user's certificate (arguments, else AVATARSTREAM_SIGN_CERT/KEY), checked by signing a
    tiny WAV; else the local self-signed one."""
    cert = cert or os.environ.get("AVATARSTREAM_SIGN_CERT") or None
    key = key or os.environ.get("AVATARSTREAM_SIGN_KEY") or None
    if (cert is None) != (key is None):
        raise ConfigError("give both the signing certificate and its key (--sign-cert and "
                          "--sign-key, or AVATARSTREAM_SIGN_CERT and AVATARSTREAM_SIGN_KEY)")
    if cert is None:
        return local_identity()
    identity = load_identity(cert, key)  # type: ignore[arg-type]
    try:
        _sign_stream(identity, _manifest("probe", "probe.wav"), "audio/wav", io.BytesIO(_tiny_wav()),
                     io.BytesIO())
    except c2pa.C2paError as e:
        raise ConfigError(f"c2pa cannot sign with the certificate {cert}: {e} (C2PA needs a "
                          "certificate issued by a CA, with the digitalSignature key usage)") from e
    return identity


def _tiny_wav() -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(b"\0\0" * 80)
    return buf.getvalue()


def _manifest(model: str, title: str) -> dict:
    agent = {"name": "avatarstream", "version": __version__}
    return {
        "claim_generator_info": [agent],
        "title": title,
        "assertions": [
            {"label": "c2pa.actions.v2", "data": {"actions": [{
                "action": "c2pa.created", "digitalSourceType": TRAINED_ALGORITHMIC_MEDIA,
                "softwareAgent": agent,
                "description": "talking-head video generated from a reference picture and speech"}]}},
            {"label": GENERATION_LABEL, "data": {
                "model": model, "synthesised_likeness": True,
                "description": "the person's face, expressions and lip movements were synthesised "
                               f"by the model {model}; the person did not perform this video"}},
        ],
    }


def _sign_stream(identity: SigningIdentity, manifest: dict, mime: str, src: object, dst: object) -> None:
    with identity.signer() as signer, c2pa.Builder(manifest) as builder:
        builder.sign(signer, mime, src, dst)


PUBLIC_KEYS = ("signed", "signer", "self_signed", "error")  # what a client may see of a Signed


def public_credentials(d: dict | None) -> dict | None:
    """A stored `Signed.as_dict()` (or an older record's) as a client may see it: only
    PUBLIC_KEYS, so no path of the server's (the certificate's) ever leaves it."""
    return None if d is None else {k: d[k] for k in PUBLIC_KEYS if k in d}


@dataclass(frozen=True)
class Signed:
    """What became of one file's signing."""

    signed: bool
    signer: str
    self_signed: bool
    certificate: str
    error: str | None = None

    def as_dict(self) -> dict:
        return {"signed": self.signed, "signer": self.signer, "self_signed": self.self_signed,
                "certificate": self.certificate, "error": self.error}

    def public_dict(self) -> dict:
        """`as_dict` without the certificate's path: what a server tells its clients (never a
        path on the server)."""
        return public_credentials(self.as_dict())

    def note(self) -> str:
        """One line for a summary."""
        if not self.signed:
            return f"content credentials: NOT signed ({self.error}); the video is complete without them"
        if self.self_signed:
            return ("content credentials: signed (C2PA, AI-generated) with the local SELF-SIGNED "
                    f"certificate {self.certificate}: verifiers report an UNTRUSTED signer; give "
                    "--sign-cert/--sign-key for your own")
        return f"content credentials: signed (C2PA, AI-generated) by {self.signer} ({self.certificate})"


@dataclass(frozen=True)
class ContentCredentials:
    """Signs the MP4s of one model with one identity."""

    identity: SigningIdentity
    model: str

    def sign_in_place(self, path: Path, title: str | None = None) -> Signed:
        """Sign the complete MP4 at `path`: a signed copy beside it, synced, renamed over it. On
        failure the copy is removed and `path` stays as it was (complete, unsigned)."""
        tmp = path.with_name(f"{path.stem}.signing-{os.getpid()}{path.suffix}")
        outcome = Signed(True, self.identity.subject, self.identity.local, str(self.identity.certificate))
        try:
            with open(path, "rb") as src, open(tmp, "w+b") as dst:
                _sign_stream(self.identity, _manifest(self.model, title or path.name), MIME, src, dst)
                dst.flush()
                os.fsync(dst.fileno())
            if os.environ.get(PAUSE_FOR_TESTS):  # unset: nothing; tests send signals here
                time.sleep(float(os.environ[PAUSE_FOR_TESTS]))
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
            os.replace(tmp, path)
        except (c2pa.C2paError, OSError) as e:
            log.warning("could not sign %s (kept unsigned): %s", path, e)
            outcome = replace(outcome, signed=False, error=_why(e))
        finally:
            tmp.unlink(missing_ok=True)
        return outcome


def model_label(model: str) -> str:
    """The model as the manifest names it: a registered name as it is; a weights folder by its
    own name, never its path (`liveavatar:/home/me/ckpt/LiveAvatar,fp8` -> `liveavatar:LiveAvatar`):
    every copy of the video carries the manifest."""
    family, colon, rest = model.partition(":")
    if colon and rest:
        return f"{family}:{Path(rest.split(',')[0].rstrip('/')).name}"
    return Path(model.rstrip("/")).name if "/" in model else model


def credentials_for(model: str, cert: str | Path | None = None,
                    key: str | Path | None = None) -> ContentCredentials:
    """What signs the outputs of `model` (see `signing_identity` for which certificate)."""
    return ContentCredentials(signing_identity(cert, key), model_label(model))
