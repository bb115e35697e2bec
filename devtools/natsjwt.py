"""NATS decentralised auth (operator mode) without ``nsc``: an operator, an account and user ``.creds``
files, made with the ``nkeys`` library (nats-py's ``nkeys`` extra).

A NATS JWT is ``base64url(header).base64url(claims).base64url(signature)``, unpadded, with the header
``{"typ": "JWT", "alg": "ed25519-nkey"}`` and the signature the issuer's nkey (ed25519) over the first two
parts. The operator signs itself and its accounts; an account signs its users. A server run with
``operator: <operator JWT>`` and ``resolver: MEMORY`` + ``resolver_preload: {<account>: <JWT>}`` admits a
user whose JWT its account signed, proven by the user's seed (the ``.creds`` file holds both). See
https://docs.nats.io/running-a-nats-service/configuration/securing_nats/jwt. ``OperatorMode.config``
writes such a server's configuration; the tests (``tests/service/replication/test_nats_creds.py``) log
robez in with ``--nats-creds``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nkeys  # dev tools only; nats-py's nkeys extra

_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
# Unlimited: what nsc writes for an account without limits, JetStream included (-1 = no limit).
_ACCOUNT_LIMITS = {
    "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True, "conn": -1,
    "leaf": -1, "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1,
}  # fmt: skip


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


@dataclass(frozen=True)
class Identity:
    """One nkey: its seed (secret) and public key (``O...``, ``A...``, ``U...``)."""

    seed: bytes
    public_key: str

    @classmethod
    def new(cls, prefix: int) -> Identity:
        seed = nkeys.encode_seed(os.urandom(32), prefix)
        return cls(seed, nkeys.from_seed(bytearray(seed)).public_key.decode())

    def sign(self, subject: str, name: str, nats: dict[str, Any], expires_s: float | None = None) -> str:
        """A JWT about ``subject`` issued (signed) by this key; ``expires_s``: seconds from now (negative:
        already expired), None: never."""
        now = int(time.time())
        claims: dict[str, Any] = {"jti": "", "iat": now, "iss": self.public_key, "name": name, "sub": subject}
        if expires_s is not None:
            claims["exp"] = now + int(expires_s)
        claims["nats"] = {**nats, "version": 2}
        claims["jti"] = base64.b32encode(hashlib.sha256(json.dumps(claims).encode()).digest()).decode()
        signing_input = f"{_b64(json.dumps(_HEADER).encode())}.{_b64(json.dumps(claims).encode())}"
        signature = nkeys.from_seed(bytearray(self.seed)).sign(signing_input.encode())
        return f"{signing_input}.{_b64(signature)}"


def creds_file(jwt: str, seed: bytes) -> str:
    """A user's ``.creds`` file (the format ``nsc generate creds`` writes, which nats clients read)."""
    return (
        f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{seed.decode()}\n------END USER NKEY SEED------\n"
    )


@dataclass
class OperatorMode:
    """An operator with one account (JetStream enabled) whose users ``user_creds`` makes."""

    operator: Identity = field(default_factory=lambda: Identity.new(nkeys.PREFIX_BYTE_OPERATOR))
    account: Identity = field(default_factory=lambda: Identity.new(nkeys.PREFIX_BYTE_ACCOUNT))
    # JetStream needs a system account in operator mode ("system account not setup" otherwise).
    system: Identity = field(default_factory=lambda: Identity.new(nkeys.PREFIX_BYTE_ACCOUNT))

    def operator_jwt(self) -> str:
        nats = {"type": "operator", "system_account": self.system.public_key}
        return self.operator.sign(self.operator.public_key, "robez-dev", nats)

    def account_jwt(self) -> str:
        nats = {"type": "account", "limits": _ACCOUNT_LIMITS, "default_permissions": {"pub": {}, "sub": {}}}
        return self.operator.sign(self.account.public_key, "robez", nats)

    def system_jwt(self) -> str:
        return self.operator.sign(self.system.public_key, "SYS", {"type": "account"})

    def user_creds(self, name: str, expires_s: float | None = None, signer: Identity | None = None) -> str:
        """A ``.creds`` file of a new user of the account, signed by ``signer`` (default: the account;
        another key makes a user the server must refuse)."""
        user = Identity.new(nkeys.PREFIX_BYTE_USER)
        nats = {"type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1}
        if signer is not None:
            nats["issuer_account"] = self.account.public_key
        jwt = (signer or self.account).sign(user.public_key, name, nats, expires_s)
        return creds_file(jwt, user.seed)

    def config(self, directory: Path, port: int) -> Path:
        """A single-node server's configuration in ``directory``: operator mode, memory resolver, JetStream
        (store under ``directory``), listening on 127.0.0.1:``port``. Returns its path."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "operator.jwt").write_text(self.operator_jwt())
        path = directory / "nats.conf"
        path.write_text(
            f"listen: 127.0.0.1:{port}\n"
            f'operator: "{directory / "operator.jwt"}"\n'
            f"system_account: {self.system.public_key}\n"
            "resolver: MEMORY\n"
            f'resolver_preload: {{\n  {self.account.public_key}: "{self.account_jwt()}"\n'
            f'  {self.system.public_key}: "{self.system_jwt()}"\n}}\n'
            f'jetstream: {{store_dir: "{directory / "js"}", max_mem: 64MB, max_file: 256MB}}\n'
        )
        return path
