"""How robez proves who it is to NATS, and checks who NATS is: credentials and TLS for ``nats.connect``.

One of: a ``.creds`` file (JWT + nkey seed, NATS's decentralised auth), an nkey seed file, or a user and
password. TLS: a CA bundle that the server's certificate must chain to, and optionally a client
certificate + key (for servers that verify clients, ``verify: true``). Files are read at connect time, so
a mounted Secret can be rotated by restarting the replica. See docs/security.md.
"""

from __future__ import annotations

import base64
import datetime
import json
import re
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from robez_core.errors import ConfigError

_CREDS_JWT = re.compile(r"-+BEGIN NATS USER JWT-+\s*(\S+)\s*-+END NATS USER JWT-+")
_CREDS_SEED = re.compile(r"-+BEGIN USER NKEY SEED-+\s*(\S+)\s*-+END USER NKEY SEED-+")


@dataclass(frozen=True)
class NatsAuth:
    """Credentials and TLS material for one NATS connection; every field optional."""

    user: str | None = None
    password: str | None = None
    creds: Path | None = None
    nkey: Path | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None

    def __post_init__(self) -> None:
        if self.password is not None and self.user is None:
            raise ValueError("a NATS password needs a NATS user")
        if sum(x is not None for x in (self.user, self.creds, self.nkey)) > 1:
            raise ValueError("give one of a NATS user (+ password), a .creds file or an nkey seed file")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("a NATS client certificate and its key go together")

    @property
    def authenticates(self) -> bool:
        """Whether any credential is set (a connection without one is refused by a secured server)."""
        return self.user is not None or self.creds is not None or self.nkey is not None

    @property
    def uses_tls(self) -> bool:
        return self.tls_ca is not None or self.tls_cert is not None

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client context that verifies the server against ``tls_ca`` (the system's CAs if unset) and
        presents the client certificate if one is set; None without TLS settings."""
        if not self.uses_tls:
            return None
        context = ssl.create_default_context(
            ssl.Purpose.SERVER_AUTH, cafile=str(self.tls_ca) if self.tls_ca is not None else None
        )
        if self.tls_cert is not None and self.tls_key is not None:
            context.load_cert_chain(str(self.tls_cert), str(self.tls_key))
        return context

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect`` (nats-py)."""
        options: dict[str, Any] = {}
        if self.user is not None:
            options["user"] = self.user
            if self.password is not None:
                options["password"] = self.password
        if self.creds is not None:
            options["user_credentials"] = str(self.creds)
        if self.nkey is not None:
            options["nkeys_seed"] = str(self.nkey)
        context = self.ssl_context()
        if context is not None:
            options["tls"] = context
        return options


def check_creds_file(path: Path, option: str = "--nats-creds") -> None:
    """Check a ``.creds`` file before the replica connects: readable, a user JWT and an nkey seed in it,
    the JWT's claims readable, not expired (``exp``), and the seed the JWT's user (``sub``). Raises
    ``ConfigError`` with one line naming the option, the file and the problem. Whether the account and
    operator trust the JWT only the server can tell: it answers "Authorization Violation"."""
    what = f"NATS credentials ({option}) {path}"
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what}: cannot be read ({exc})") from exc
    jwt, seed = _CREDS_JWT.search(text), _CREDS_SEED.search(text)
    if jwt is None or seed is None:
        raise ConfigError(f"{what}: no user JWT and nkey seed in it (not a .creds file)")
    try:
        claims_part = jwt.group(1).split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(claims_part + "=" * (-len(claims_part) % 4)))
        subject, expires = claims["sub"], claims.get("exp")
    except (IndexError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{what}: its JWT cannot be read ({exc})") from exc
    if expires is not None and expires <= datetime.datetime.now(datetime.UTC).timestamp():
        when = datetime.datetime.fromtimestamp(expires, datetime.UTC)
        raise ConfigError(f"{what}: its user JWT expired on {when:%Y-%m-%d %H:%M} UTC")
    import nkeys  # nats-py's nkeys extra, which reads .creds files

    try:
        public_key = nkeys.from_seed(bytearray(seed.group(1).encode())).public_key.decode()
    except Exception as exc:  # nkeys raises its own errors and binascii's for a bad seed
        raise ConfigError(f"{what}: its nkey seed cannot be read ({exc!r})") from exc
    if public_key != subject:
        raise ConfigError(f"{what}: its nkey seed is not the JWT's user ({subject})")
