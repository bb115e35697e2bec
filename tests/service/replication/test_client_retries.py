"""The client's side of exactly-once pushes: a key per push, resent unchanged; what it resends when."""

from __future__ import annotations

import httpx
import pytest
import torch

from service.client import RemoteEmbedding, RobezClient


def _ok(request: httpx.Request, replica: bool = True) -> httpx.Response:
    headers = {"X-Robez-Replica": "r1"} if replica else {}
    return httpx.Response(200, json={"table": "t", "version": 3}, headers=headers)


def test_every_push_has_its_own_key_and_a_resend_keeps_it() -> None:
    keys: list[str] = []
    failures = iter([httpx.ConnectError("refused"), None, None])

    def handler(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers["Idempotency-Key"])
        failure = next(failures)
        if failure is not None:
            raise failure
        return _ok(request)

    with RobezClient(transport=httpx.MockTransport(handler)) as client:
        assert client.update("t", [1], torch.ones(1, 4)) == 3
        client.update("t", [1], torch.ones(1, 4))
    assert keys[0] == keys[1] != keys[2]  # the resend after the connect error kept its key
    assert len(keys[0]) == 32


@pytest.mark.parametrize("seen_replica", [True, False])
def test_lost_answer_is_resent_only_to_a_replica(seen_replica: bool) -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.headers["Idempotency-Key"])
        if len(calls) == 2:
            raise httpx.ReadError("connection reset after the request was sent")
        return _ok(request, replica=seen_replica)

    with RobezClient(transport=httpx.MockTransport(handler)) as client:
        client.update("t", [1], torch.ones(1, 4))  # learns whether the server dedups keys
        if seen_replica:
            assert client.update("t", [2], torch.ones(1, 4)) == 3
            assert calls[1] == calls[2]
        else:
            # A single server ignores the key: resending could apply the push twice.
            with pytest.raises(httpx.ReadError):
                client.update("t", [2], torch.ones(1, 4))
            assert len(calls) == 2


def test_remote_embedding_reads_its_own_writes() -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/lookup"):
            seen.append(request.headers.get("X-Robez-Min-Version"))
            n = len(request.content) // 8
            return httpx.Response(
                200, content=bytes(n * 4 * 4), headers={"X-Robez-Shape": f"{n},4", "X-Robez-Version": "3"}
            )
        return _ok(request)

    with RobezClient(transport=httpx.MockTransport(handler)) as client:
        module = RemoteEmbedding(client, "t", embedding_dim=4)
        module(torch.tensor([1, 2])).sum().backward()
        module(torch.tensor([1]))
    assert seen == [None, "3"]
