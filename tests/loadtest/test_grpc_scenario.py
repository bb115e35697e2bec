"""The load test's gRPC scenario against a real robez serving gRPC: answers check out, errors count."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loadtest.runner import ClientFleet, RunSpec
from loadtest.scenarios import ScenarioContext
from loadtest.server import MAIN_TABLE, TABLE_CONFIG, running_server
from loadtest.transport import GRPC

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[ScenarioContext, ScenarioContext]]:
    """One robez serve with gRPC: a context for its table and one for a table it does not have."""
    with running_server(1, None, grpc=True) as robez:
        context = ScenarioContext(
            target=robez.target,
            table=MAIN_TABLE,
            tables=(MAIN_TABLE,),
            embedding_dim=TABLE_CONFIG["embedding_dim"],
            num_ids=1000,
            grpc_target=robez.grpc_target,
        )
        yield context, ScenarioContext(**{**context.__dict__, "table": "nope"})


def test_grpc_scenario_runs_and_checks_answers(server: tuple[ScenarioContext, ScenarioContext]) -> None:
    context, missing = server
    with ClientFleet(1) as fleet:
        spec = RunSpec("g", "grpc", batch_size=16, concurrency=2, max_requests=200, transport=GRPC)
        result = fleet.run(spec, context)
        assert result.ok == result.sent == 200 and result.errors == {}, result.error_samples
        assert result.rows == 200 * 16 and result.latency_ms.count == 200
        assert not result.failed
        refused = fleet.run(RunSpec("g", "grpc", concurrency=1, max_requests=5, transport=GRPC), missing)
    assert refused.errors == {"status 404": 5} and refused.failed
    assert any("nope" in sample for sample in refused.error_samples)
