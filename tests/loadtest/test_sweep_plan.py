"""Which runs the sweep measures against a server after the first (no server, no clients: the plan only)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

import loadtest.sweep as sweep_module
from loadtest.__main__ import build_parser, config_from_args
from loadtest.runner import RunSpec
from loadtest.sweep import Sweep, SweepConfig
from loadtest.transport import Target


@contextlib.contextmanager
def _no_fleet(processes: int, cores: tuple[int, ...] | None) -> Iterator[None]:
    yield None


def _measured_at_second_server(monkeypatch: pytest.MonkeyPatch, **options: Any) -> list[tuple[str, int]]:
    monkeypatch.setattr(sweep_module, "ClientFleet", _no_fleet)
    monkeypatch.setattr(sweep_module, "_embedding_dim", lambda target, table, api_key: 64)
    monkeypatch.setattr(sweep_module, "_warm_up", lambda target, table, batches, api_key: None)
    config = SweepConfig(cpus=(1, 2), scenarios=("json", "binary", "update", "mix"), batch_sizes=(4096,))
    sweep = Sweep(SweepConfig(**{**config.__dict__, **options}), "python -m loadtest", lambda line: None)
    measured: list[tuple[str, int]] = []

    def fake_measure(fleet: object, spec: RunSpec, *args: object) -> SimpleNamespace:
        measured.append((spec.scenario, spec.batch_size))
        return SimpleNamespace(requests_per_s=1.0)

    monkeypatch.setattr(sweep, "_measure", fake_measure)
    sweep._against(Target("127.0.0.1", 9), None, server_cores=(0,), server_pid=None, first=False)
    return measured


def test_later_servers_measure_lookups_only_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _measured_at_second_server(monkeypatch) == [("json", 1), ("binary", 4096)]


def test_features_every_count_measures_updates_and_the_mix_at_every_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    measured = _measured_at_second_server(monkeypatch, features_every_count=True)
    batch = SweepConfig.feature_batch
    assert measured == [("json", 1), ("binary", 4096), ("update", 8), ("update", batch), ("mix", batch)]


def test_machine_name_names_the_report(monkeypatch: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(["--machine-name", "device-16c", "--cpus", "1"])
    sweep = Sweep(config_from_args(args), "python -m loadtest", lambda line: None)
    assert sweep.result.machine["host"] == "device-16c"
    with pytest.raises(ValueError, match="machine-name"):
        config_from_args(build_parser().parse_args(["--machine-name", "a/b"]))
