"""HTTPS on robez's port (``--tls-cert``/``--tls-key``, client certificates with ``--tls-client-ca``),
with certificates made here by ``trustme``: lookups over https through the Python client and
``RemoteEmbedding``, and what is refused: plain http, a client that does not trust the CA, a client
without a certificate."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import pytest
import torch
import trustme

from service.client import RemoteEmbedding, RobezClient, tls_verify

from .subprocess_server import RobezServer

pytestmark = pytest.mark.slow


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
