"""Saturation: bounded in-flight requests per worker, the rest answered 503 with Retry-After at once."""

from __future__ import annotations

import anyio
import httpx

from service.limits import InFlightLimitMiddleware
from service.metrics import Metrics


def test_saturated_worker_answers_503_with_retry_after() -> None:
    release = anyio.Event()
    entered = anyio.Event()

    async def slow_app(scope, receive, send):
        if scope["path"] != "/healthz":
            entered.set()
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    metrics = Metrics()
    app = InFlightLimitMiddleware(slow_app, max_in_flight=1, retry_after_s=3, metrics=metrics)

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            results: dict[str, httpx.Response] = {}

            async def first() -> None:
                results["first"] = await client.post("/v1/tables/demo/lookup")

            async with anyio.create_task_group() as group:
                group.start_soon(first)
                with anyio.fail_after(10):
                    await entered.wait()
                refused = await client.post("/v1/tables/demo/lookup")
                probe = await client.get("/healthz")  # probes bypass the limit
                release.set()
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "3"
            assert refused.json()["error_type"] == "BusyError"
            assert "max_in_flight=1" in refused.json()["error"]
            assert probe.status_code == 200
            assert results["first"].status_code == 200
            after = await client.post("/v1/tables/demo/lookup")
            assert after.status_code == 200  # the slot was given back

    anyio.run(scenario)
    samples = {s.name: s.value for m in metrics.registry.collect() for s in m.samples}
    assert samples["robez_rejected_total"] == 1.0
