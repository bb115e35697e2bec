"""HTTPS on robez's port (``--tls-cert``/``--tls-key``, client certificates with ``--tls-client-ca``),
with certificates made here by ``trustme``: lookups over https through the Python client and
``RemoteEmbedding``, and what is refused: plain http, a client that does not trust the CA, a client
without a certificate. And the start-up checks of the files (``service/tls.py``): a missing,
unreadable, mismatched, expired or not-yet-valid file stops the server at once, one line naming it."""

from __future__ import annotations

import datetime
import os
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import trustme

from robez_core.errors import ConfigError
from service.client import RemoteEmbedding, RobezClient, tls_verify
from service.tls import check_pair

from .subprocess_server import RobezServer

OPTIONS = ("--tls-cert", "--tls-key", "--tls-client-ca")


def _write_pair(
    ca: trustme.CA,
    directory: Path,
    name: str,
    not_before: datetime.datetime | None = None,
    not_after: datetime.datetime | None = None,
) -> tuple[Path, Path]:
    cert = ca.issue_cert("127.0.0.1", not_before=not_before, not_after=not_after)
    cert_file, key_file = directory / f"{name}.pem", directory / f"{name}.key"
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    return cert_file, key_file


def test_start_up_checks_name_the_file_and_the_problem(tmp_path: Path) -> None:
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cert, key = _write_pair(ca, tmp_path, "server")
    check_pair(cert, key, ca_file, OPTIONS)  # a good pair passes

    _, other_key = _write_pair(ca, tmp_path, "other")
    now = datetime.datetime.now(datetime.UTC)
    expired, expired_key = _write_pair(
        ca,
        tmp_path,
        "expired",
        not_before=now - datetime.timedelta(days=10),
        not_after=now - datetime.timedelta(days=1),
    )
    early, early_key = _write_pair(
        ca,
        tmp_path,
        "early",
        not_before=now + datetime.timedelta(days=1),
        not_after=now + datetime.timedelta(days=10),
    )
    from cryptography.hazmat.primitives import serialization

    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        serialization.load_pem_private_key(key.read_bytes(), password=None).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    cases = [
        (
            (tmp_path / "missing.pem", key, None),
            rf"--tls-cert\) {tmp_path}/missing.pem: cannot read it: No such file",
        ),
        ((tmp_path, key, None), rf"--tls-cert\) {tmp_path}: cannot read it: Is a directory"),
        ((cert, tmp_path / "missing.key", None), r"--tls-key\) .*missing.key: cannot read it"),
        ((cert, cert, None), r"--tls-key\) .*server.pem: not a PEM private key"),
        ((garbage, key, None), r"--tls-cert\) .*garbage.pem: not a PEM certificate"),
        ((cert, encrypted, None), r"--tls-key\) .*encrypted.key: the key is encrypted"),
        ((cert, other_key, None), rf"other.key: not the private key of the certificate {cert}"),
        ((expired, expired_key, None), r"expired.pem: expired on 20"),
        ((early, early_key, None), r"early.pem: not valid yet \(valid from 20"),
        ((cert, key, tmp_path / "nope.pem"), r"--tls-client-ca\) .*nope.pem: cannot read it"),
        ((cert, key, key), r"--tls-client-ca\) .*server.key: not a PEM certificate"),
    ]
    for arguments, message in cases:
        with pytest.raises(ConfigError, match=message) as raised:
            check_pair(*arguments, OPTIONS)
        assert "\n" not in str(raised.value)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_bad_key_stops_the_server_at_once_whatever_the_worker_count(tmp_path: Path, workers: int) -> None:
    """It was respawned forever with two workers ("14 died young in a row"), and stopped only after the
    tables loaded with a 35-line traceback naming no file with one (issue 40.4)."""
    ca = trustme.CA()
    cert, _ = _write_pair(ca, tmp_path, "server")
    _, other_key = _write_pair(ca, tmp_path, "other")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROBEZ_")}
    env.update(
        {"ROBEZ_SHM_DIR": str(tmp_path / "shm"), "ROBEZ_TLS_CERT": str(cert), "ROBEZ_TLS_KEY": str(other_key)}
    )
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--port", "0", "--workers", str(workers)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert lines == [
        f"robez: ConfigError: TLS key (--tls-key) {other_key}: not the private key of the certificate {cert}"
    ]
    assert not list((tmp_path / "shm").glob("robez-*")), "the tables were prepared before the check"
    assert time.monotonic() - started < 60


@pytest.mark.timeout(120)
def test_a_worker_that_fails_its_start_up_is_not_respawned(tmp_path: Path) -> None:
    """A worker whose TLS files fail to load (changed after the start-up check) exits with uvicorn's
    start-up failure status, and the supervisor stops instead of respawning it in a loop."""
    import socket

    import uvicorn

    from service.supervisor import WorkerSupervisor

    ca = trustme.CA()
    cert, _ = _write_pair(ca, tmp_path, "server")
    _, other_key = _write_pair(ca, tmp_path, "other")
    config = uvicorn.Config(
        "service.app:create_app_from_env",
        factory=True,
        log_level="critical",
        ssl_certfile=str(cert),
        ssl_keyfile=str(other_key),
    )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        supervisor = WorkerSupervisor(config, [sock], workers=2, healthcheck_timeout_s=60)
        assert supervisor.run() == uvicorn.config.STARTUP_FAILURE
    assert all(worker is None or not worker.process.is_alive() for worker in supervisor.workers)


@pytest.mark.slow
def test_lookups_over_https_and_what_is_refused(tmp_path: Path) -> None:
    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1")
    client_cert = ca.issue_cert("trainer")
    ca_file, cert_file, key_file = tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "server.key"
    client_file = tmp_path / "client.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    server_cert.cert_chain_pems[0].write_to_path(str(cert_file))
    server_cert.private_key_pem.write_to_path(str(key_file))
    client_cert.private_key_and_cert_chain_pem.write_to_path(str(client_file))
    client_tls = (client_file, client_file)
    env = {
        "ROBEZ_SHM_DIR": str(tmp_path / "shm"),
        "ROBEZ_TLS_CERT": str(cert_file),
        "ROBEZ_TLS_KEY": str(key_file),
        "ROBEZ_TLS_CLIENT_CA": str(ca_file),
    }
    context = tls_verify(ca_file, client_tls)
    assert isinstance(context, ssl.SSLContext)
    server = RobezServer(tmp_path / "server.log", [], env, verify=context)
    try:
        server.start()
        assert server.url.startswith("https://")
        ids = torch.tensor([1, 5, 99])
        with RobezClient(server.url, verify=ca_file, cert=client_tls) as client:
            rows = client.lookup("demo", ids)
        assert rows.shape == (3, 64)
        with RobezClient(server.url, verify=ca_file, cert=client_tls) as client:
            embedding = RemoteEmbedding(client, "demo")
            with torch.no_grad():
                assert torch.equal(embedding(ids), rows)

        plain = server.url.replace("https://", "http://")
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{plain}/readyz", timeout=10)
        with (
            RobezClient(server.url, cert=client_tls) as client,  # the system's CAs only
            pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"),
        ):
            client.lookup("demo", ids)
        with (
            RobezClient(server.url, verify=ca_file, timeout=10, busy_retries=0) as client,
            pytest.raises(httpx.TransportError),  # the server requires a client certificate
        ):
            client.lookup("demo", ids)
    finally:
        server.stop()


def test_grpc_serves_the_same_mutual_tls_as_https(tmp_path: Path) -> None:
    """With --tls-cert/--tls-key/--tls-client-ca and --grpc-port, gRPC required no certificate and
    served plaintext (issue 40.3): now a client needs one from the CA, and plaintext is refused."""
    import grpc
    import numpy as np
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc

    from .threaded_server import app_server

    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cert, key = _write_pair(ca, tmp_path, "server")
    client = ca.issue_cert("trainer")
    server = app_server(tmp_path / "data", grpc_port=0, tls_cert=cert, tls_key=key, tls_client_ca=ca_file)
    try:
        port = server.server.config.loaded_app.app.state.grpc_port
        address = f"127.0.0.1:{port}"
        request = pb.ModelInferRequest(model_name="demo")
        tensor = request.inputs.add(name="ids", datatype="INT64", shape=[3])
        tensor.contents.int64_contents.extend([1, 5, 99])

        def infer(channel: grpc.Channel) -> Any:
            with channel:
                return service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=20)

        with_certificate = grpc.ssl_channel_credentials(
            root_certificates=ca.cert_pem.bytes(),
            private_key=client.private_key_pem.bytes(),
            certificate_chain=client.cert_chain_pems[0].bytes(),
        )
        response = infer(grpc.secure_channel(address, with_certificate))
        rows = np.array(response.outputs[0].contents.fp32_contents, dtype=np.float32)
        assert rows.shape == (3 * 64,)

        without_certificate = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem.bytes())
        for channel in (grpc.secure_channel(address, without_certificate), grpc.insecure_channel(address)):
            with pytest.raises(grpc.RpcError) as refused:
                infer(channel)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()
