"""Settings from ROBEZ_* and the CLI, the tables file, the robez command's help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from robez_core.errors import ConfigError
from robez_core.hostinfo import usable_cpus
from service.app import WORKER_SHM_VARIABLE
from service.cli import _environment_for_workers, _parser, _settings_from
from service.config import Settings, load_tables_file


def test_every_option_reads_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROBEZ_PORT", "9123")
    monkeypatch.setenv("ROBEZ_WORKERS", "3")
    monkeypatch.setenv("ROBEZ_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("ROBEZ_MAX_IDS_PER_REQUEST", "77")
    settings = Settings()
    assert (settings.port, settings.workers, settings.data_dir, settings.max_ids_per_request) == (
        9123,
        3,
        tmp_path,
        77,
    )
    # CLI options win over the environment.
    args = _parser().parse_args(["serve", "--port", "9999", "--host", "0.0.0.0"])
    assert (_settings_from(args).port, _settings_from(args).host, _settings_from(args).workers) == (
        9999,
        "0.0.0.0",
        3,
    )
    monkeypatch.setenv("ROBEZ_PORT", "not-a-port")
    with pytest.raises(ValidationError):
        Settings()


def test_workers_inherit_the_parents_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    parent = _settings_from(
        _parser().parse_args(["serve", "--port", "9001", "--workers", "2", "--data-dir", str(tmp_path)])
    )
    (tmp_path / "shm").mkdir()
    env = _environment_for_workers(parent, tmp_path / "shm")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    worker = Settings()
    assert worker.model_dump() == parent.model_dump()
    # The shared directory is handed over beside the settings, not as one.
    assert env[WORKER_SHM_VARIABLE] == str(tmp_path / "shm")
    assert env["PROMETHEUS_MULTIPROC_DIR"] == str(tmp_path / "shm" / "metrics")
    assert "GRPC_EXPERIMENTS" not in env  # no gRPC served: gRPC's own settings untouched


def test_grpc_workers_get_grpc_settings_unless_set(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from service.grpc import GRPC_EXPERIMENTS

    monkeypatch.delenv("GRPC_EXPERIMENTS", raising=False)
    settings = _settings_from(_parser().parse_args(["serve", "--grpc-port", "0"]))
    assert _environment_for_workers(settings, tmp_path)["GRPC_EXPERIMENTS"] == GRPC_EXPERIMENTS
    monkeypatch.setenv("GRPC_EXPERIMENTS", "")  # the operator's, even empty (gRPC's defaults), is kept
    assert "GRPC_EXPERIMENTS" not in _environment_for_workers(settings, tmp_path)


def test_the_grpc_engine_option_reaches_the_workers(tmp_path: Path) -> None:
    for args, engine in (([], "frames"), (["--grpc-engine", "grpcio"], "grpcio")):
        settings = _settings_from(_parser().parse_args(["serve", "--grpc-port", "0", *args]))
        assert settings.grpc_engine == engine
        assert _environment_for_workers(settings, tmp_path)["ROBEZ_GRPC_ENGINE"] == engine
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--grpc-engine", "h2"])


def test_threads_per_worker_default_shares_the_cpus() -> None:
    assert Settings(workers=1).kernel_threads() == usable_cpus()
    assert Settings(workers=usable_cpus() * 4).kernel_threads() == 1
    assert Settings(workers=2, threads_per_worker=3).kernel_threads() == 3


def test_tables_file(tmp_path: Path) -> None:
    path = tmp_path / "tables.toml"
    path.write_text(
        '[tables.users]\nnum_embeddings = 1000\nembedding_dim = 16\nmemory_size = 4096\nhash = "fast"\n'
        '[tables.users.optimizer]\nname = "adam"\nlr = 0.001\nbetas = [0.8, 0.99]\n'
        "[tables.users_b]\nnum_embeddings = 1000\nembedding_dim = 16\nmemory_size = 4096\nval_offset = 99\n"
        'share_array_with = "users"\n'
        '[tables.users_b.optimizer]\nname = "adam"\nlr = 0.001\nbetas = [0.8, 0.99]\n'
    )
    specs = load_tables_file(path)
    assert list(specs) == ["users", "users_b"]
    assert specs["users"].config.hash == "fast" and specs["users"].optimizer.betas == (0.8, 0.99)
    assert specs["users_b"].share_array_with == "users"
    bad = {
        "[tables.x]\nembedding_dim = 4\n": "x",  # missing keys
        "[tables.x]\nnum_embeddings = 1\nembedding_dim = 4\nmemory_size = 2\n": "x",  # m < Z
        "[tables.x]\nnum_embeddings = 1\nembedding_dim = 4\nmemory_size = 64\ncolour = 1\n": "colour",
        "[server]\nport = 1\n": "top-level",
        "not toml at all [": "TOML",
    }
    for text, fragment in bad.items():
        path.write_text(text)
        with pytest.raises(ConfigError, match=fragment):
            load_tables_file(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_tables_file(tmp_path / "missing.toml")


def test_robez_help() -> None:
    for argv in (["--help"], ["serve", "--help"]):
        result = subprocess.run(
            [sys.executable, "-m", "service", *argv], capture_output=True, text=True, timeout=120, check=True
        )
        assert "robez" in result.stdout
    serve_help = result.stdout
    for option in ("--host", "--port", "--workers", "--config", "--data-dir"):
        assert option in serve_help


def test_a_body_of_max_body_bytes_must_fit_in_the_bodies_a_worker_holds() -> None:
    with pytest.raises(ValidationError, match="max_body_bytes_held"):
        Settings(_env_file=None, max_body_bytes=2048, max_body_bytes_held=1024)  # type: ignore[call-arg]
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    assert settings.max_json_body_bytes < settings.max_body_bytes <= settings.max_body_bytes_held


def test_the_connection_protocol_pickles_into_spawned_workers() -> None:
    """uvicorn pickles its Config (with the ``http`` protocol factory) into each spawned worker."""
    import pickle

    from service.http.protocol import RobezHttpProtocol, uvicorn_options

    settings = Settings(_env_file=None, header_timeout_s=2.5, max_connections=7)  # type: ignore[call-arg]
    factory = pickle.loads(pickle.dumps(uvicorn_options(settings)["http"]))
    assert factory.func is RobezHttpProtocol
    assert factory.keywords["limits"].header_timeout_s == 2.5
    assert factory.keywords["limits"].max_connections == 7


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"nats_password": "x"}, "a NATS password needs a NATS user"),
        ({"nats_user": "u", "nats_nkey": "seed.nk"}, "give one of"),
        ({"nats_tls_cert": "c.pem"}, "certificate and its key go together"),
        ({"tls_cert": "c.pem"}, "tls_cert and tls_key go together"),
        ({"tls_client_ca": "ca.pem"}, "tls_client_ca needs tls_cert"),
    ],
)
def test_half_given_credentials_are_a_start_up_error(settings: dict[str, str], problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        Settings(_env_file=None, **settings)  # type: ignore[call-arg]
