"""deploy/cluster: read the compose file (no Docker engine in CI) and check the NATS config with the
real nats-server's config test; the container test (deploy/container_test) publishes the stack where the
file lets it."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from devtools.natscluster import NATS_MAX_PAYLOAD, nats_server_binary
from service.config import Settings

CLUSTER = Path(__file__).resolve().parents[3] / "deploy" / "cluster"


def _compose() -> dict[str, Any]:
    return dict(yaml.safe_load((CLUSTER / "docker-compose.yml").read_text()))


def test_three_nats_three_replicas_and_a_load_balancer() -> None:
    services = _compose()["services"]
    nats_nodes = [name for name in services if name.startswith("nats")]
    replicas = [name for name in services if name.startswith("robez")]
    assert len(nats_nodes) == 3 and len(replicas) == 3 and "lb" in services
    for name in replicas:
        environment = services[name]["environment"]
        assert set(environment) <= {f"ROBEZ_{field.upper()}" for field in Settings.model_fields}
        urls = environment["ROBEZ_NATS_URL"].split(",")
        assert sorted(urls) == sorted(f"nats://{node}:4222" for node in nats_nodes)
        assert environment["ROBEZ_NATS_REPLICAS"] == "3"
        assert environment["ROBEZ_REPLICA_NAME"] == name
        assert "--data-dir" not in services[name]["command"]  # a replica's journal is the log
        # NATS is closed to strangers: a login and the CA + client certificate, mounted as secrets.
        assert environment["ROBEZ_NATS_USER"] == "robez"
        assert services[name]["env_file"] == "./secrets/robez.env"
        for variable in ("ROBEZ_NATS_TLS_CA", "ROBEZ_NATS_TLS_CERT", "ROBEZ_NATS_TLS_KEY"):
            assert environment[variable].startswith("/run/secrets/")
    nats_conf = (CLUSTER / "nats.conf").read_text()
    assert nats_conf.count("verify: true") == 2  # clients and routes present certificates
    assert "authorization {" in nats_conf
    haproxy = (CLUSTER / "haproxy.cfg").read_text()
    assert "GET /readyz" in haproxy
    assert sorted(re.findall(r"server (robez\d) ", haproxy)) == sorted(replicas)


def test_nats_config_is_valid_and_fsyncs_every_message(tmp_path: Path) -> None:
    config = CLUSTER / "nats.conf"
    assert re.search(r"sync_interval:\s*always", config.read_text())
    # The same push limit as the dev/test cluster's, so a push that works under `make cluster` works here.
    assert re.search(rf"^max_payload:\s*{NATS_MAX_PAYLOAD}$", config.read_text(), re.MULTILINE)
    secrets = tmp_path / "secrets"
    subprocess.run(["sh", str(CLUSTER / "make-secrets.sh"), str(secrets)], check=True, timeout=60)
    passwords = dict(
        line.split("=", 1) for line in (secrets / "nats.env").read_text().splitlines() if "=" in line
    )
    tls = {"NATS_TLS_CA": "ca.pem", "NATS_TLS_CERT": "server.pem", "NATS_TLS_KEY": "server.key"}
    result = subprocess.run(
        [nats_server_binary(), "-t", "-c", str(config)],
        env={
            **os.environ,
            "SERVER_NAME": "nats1",
            **passwords,
            **{name: str(secrets / file) for name, file in tls.items()},
        },
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_load_balancer_host_port_is_a_variable_the_container_test_sets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loopback only, port 8080 unless Compose's variable says otherwise; `make container-test` sets that
    variable to a free port, so a server on 8080 does not stop it."""
    (mapping,) = _compose()["services"]["lb"]["ports"]
    published = re.fullmatch(r"127\.0\.0\.1:\$\{(ROBEZ_\w+):-8080\}:8080", mapping)
    assert published is not None, mapping
    monkeypatch.syspath_prepend(str(CLUSTER.parents[0]))  # deploy/, as `make container-test` runs it
    from container_test.__main__ import cluster_compose
    from container_test.engine import Engine

    compose = cluster_compose(Path("docker-compose"), Engine(tmp_path))
    assert compose.file == "deploy/cluster/docker-compose.yml"
    assert compose.env[published[1]] == str(compose.port)
