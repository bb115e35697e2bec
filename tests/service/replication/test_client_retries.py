"""The client's side of exactly-once pushes: a key per push, resent unchanged; what it resends when."""

from __future__ import annotations

import httpx
import pytest
import torch

from service.client import RemoteEmbedding, RobezClient, RobezClientError


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


def test_a_push_over_the_servers_limit_is_split_in_order_with_derived_keys() -> None:
    """A replica's 413 names the largest update body it takes; the client sends the push again as parts
    of that size, in order, keys ``{key}.{i}``, and splits later pushes before sending."""
    limit = 3 * (8 + 4 * 4)  # three ids x 4 per part
    seen: list[tuple[str, list[int]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        num_ids = int(request.headers["X-Robez-Shape"].split(",")[0])
        if len(request.content) > limit:
            return httpx.Response(
                413,
                json={"error": "over the limit", "error_type": "UpdateTooLargeError"},
                headers={"X-Robez-Max-Update-Bytes": str(limit)},
            )
        ids = torch.frombuffer(bytearray(request.content[: 8 * num_ids]), dtype=torch.int64).tolist()
        seen.append((request.headers["Idempotency-Key"], ids))
        return httpx.Response(
            200, json={"table": "t", "version": len(seen)}, headers={"X-Robez-Replica": "r1"}
        )

    with RobezClient(transport=httpx.MockTransport(handler)) as client:
        assert client.update("t", list(range(7)), torch.ones(7, 4)) == 3
        assert client.max_update_bytes == limit
        assert [ids for _, ids in seen] == [[0, 1, 2], [3, 4, 5], [6]]
        key = seen[0][0].rsplit(".", 1)[0]
        assert [k for k, _ in seen] == [f"{key}.0", f"{key}.1", f"{key}.2"]
        seen.clear()
        client.update("t", list(range(4)), torch.ones(4, 4))  # split before sending: no second 413
        assert [ids for _, ids in seen] == [[0, 1, 2], [3]]


@pytest.mark.parametrize("status", [400, 404, 409, 413, 422])
def test_a_4xx_is_never_sent_again(status: int) -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.headers["Idempotency-Key"])
        return httpx.Response(
            status, json={"error": "no", "error_type": "Refused"}, headers={"Retry-After": "0"}
        )

    client = RobezClient(transport=httpx.MockTransport(handler), busy_retries=3)
    with client, pytest.raises(RobezClientError) as raised:
        client.update("t", [1], torch.ones(1, 4))
    assert raised.value.status == status
    assert len(calls) == 1
