"""The server's TLS files: checked once at start-up, and one policy for every port that listens.

``check_files(settings)`` runs in ``robez serve`` before anything else (before the data directory is
locked and the tables load, before a worker is spawned): a missing, unreadable or malformed certificate,
key or CA file, a key that is not the certificate's, or a certificate outside its validity period stops
the server with one line naming the file, its option and the problem (``ConfigError``). Without it
uvicorn failed in each worker after the tables had loaded, with a traceback naming no file, and several
workers were respawned forever (issue 40.4). The NATS client's files (``--nats-tls-*``, and the JWT and
seed of ``--nats-creds``) are checked the same way.

``server_credentials(settings)`` gives the PEM bytes the gRPC port serves with: the HTTP port's
certificate and key, and client certificates required when ``--tls-client-ca`` is set, as uvicorn does
for HTTPS (docs/security.md).
"""

from __future__ import annotations

import datetime
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

from robez_core.errors import ConfigError

from .config import Settings
from .natsauth import check_creds_file


@dataclass(frozen=True)
class ServerCredentials:
    """PEM bytes of the server's TLS identity: ``certificate_chain`` (leaf first), its ``private_key``,
    and ``client_ca`` (None: clients need no certificate)."""

    certificate_chain: bytes
    private_key: bytes
    client_ca: bytes | None


def _read(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read it: {exc.strerror or exc}") from exc
    if not data.strip():
        raise ConfigError(f"{what} {path}: the file is empty")
    return data


def _certificates(path: Path, what: str) -> list[x509.Certificate]:
    data = _read(path, what)
    try:
        certificates = x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise ConfigError(f"{what} {path}: not a PEM certificate") from exc
    return certificates


def _check_validity(certificate: x509.Certificate, path: Path, what: str, now: datetime.datetime) -> None:
    if now < certificate.not_valid_before_utc:
        raise ConfigError(
            f"{what} {path}: not valid yet (valid from {certificate.not_valid_before_utc:%Y-%m-%d %H:%M} "
            "UTC; check the clock or the certificate)"
        )
    if now > certificate.not_valid_after_utc:
        raise ConfigError(f"{what} {path}: expired on {certificate.not_valid_after_utc:%Y-%m-%d %H:%M} UTC")


def _private_key(path: Path, what: str) -> PrivateKeyTypes:
    data = _read(path, what)
    try:
        return serialization.load_pem_private_key(data, password=None)
    except TypeError as exc:  # encrypted: uvicorn and gRPC are given no password
        raise ConfigError(f"{what} {path}: the key is encrypted; give an unencrypted PEM key") from exc
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"{what} {path}: not a PEM private key") from exc


def _public_der(key: object) -> bytes:
    return key.public_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def check_pair(
    cert: Path,
    key: Path,
    ca: Path | None,
    options: tuple[str, str, str],
    now: datetime.datetime | None = None,
) -> None:
    """Check a certificate (``cert``, PEM, leaf first), its private ``key`` and an optional CA bundle, as
    named by ``options`` (e.g. ``("--tls-cert", "--tls-key", "--tls-client-ca")``); ``ConfigError``
    naming the file and the problem for the first one found. ``now`` defaults to the clock (UTC)."""
    now = now or datetime.datetime.now(datetime.UTC)
    cert_what, key_what, ca_what = (
        f"TLS {kind} ({option})" for kind, option in zip(("certificate", "key", "CA"), options, strict=True)
    )
    leaf = _certificates(cert, cert_what)[0]
    _check_validity(leaf, cert, cert_what, now)
    private_key = _private_key(key, key_what)
    if _public_der(private_key.public_key()) != _public_der(leaf.public_key()):
        raise ConfigError(f"{key_what} {key}: not the private key of the certificate {cert}")
    if ca is not None:
        authorities = _certificates(ca, ca_what)
        if all(now > authority.not_valid_after_utc for authority in authorities):
            raise ConfigError(
                f"{ca_what} {ca}: expired on {authorities[0].not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
            )
    # What the ssl module itself will load (a key type or format cryptography reads and OpenSSL not).
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
        if ca is not None:
            context.load_verify_locations(ca)
    except ssl.SSLError as exc:
        raise ConfigError(f"{cert_what} {cert} with {key}: refused by OpenSSL: {exc.reason or exc}") from exc


def check_files(settings: Settings) -> None:
    """Check every TLS file ``settings`` name (the HTTP/gRPC port's, and NATS's client files) before the
    server starts; ``ConfigError`` with one line naming the file and the problem."""
    if settings.tls_cert is not None and settings.tls_key is not None:
        check_pair(
            settings.tls_cert,
            settings.tls_key,
            settings.tls_client_ca,
            ("--tls-cert", "--tls-key", "--tls-client-ca"),
        )
    if settings.nats_tls_cert is not None and settings.nats_tls_key is not None:
        check_pair(
            settings.nats_tls_cert,
            settings.nats_tls_key,
            settings.nats_tls_ca,
            ("--nats-tls-cert", "--nats-tls-key", "--nats-tls-ca"),
        )
    elif settings.nats_tls_ca is not None:
        _certificates(settings.nats_tls_ca, "TLS CA (--nats-tls-ca)")
    if settings.nats_creds is not None:
        check_creds_file(settings.nats_creds)


def server_credentials(settings: Settings) -> ServerCredentials | None:
    """The PEM bytes every listening port serves TLS with (None: TLS is not configured)."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    client_ca = settings.tls_client_ca
    return ServerCredentials(
        certificate_chain=_read(settings.tls_cert, "TLS certificate (--tls-cert)"),
        private_key=_read(settings.tls_key, "TLS key (--tls-key)"),
        client_ca=_read(client_ca, "TLS CA (--tls-client-ca)") if client_ca is not None else None,
    )
