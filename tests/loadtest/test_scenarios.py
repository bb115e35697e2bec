"""The scenarios' request pools decode to what they claim, and responses are checked by shape."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from loadtest.scenarios import (
    FLOOR_ROWS,
    PEER_UPDATE,
    SCENARIOS,
    RequestTemplate,
    ScenarioContext,
    build_requests,
    check_response,
)
from loadtest.transport import Response, Target

DIM = 8
CONTEXT = ScenarioContext(
    target=Target("127.0.0.1", 8000),
    table="t",
    tables=("t", "u", "v"),
    embedding_dim=DIM,
    num_ids=1000,
    bag_size=4,
)


def _body(template: RequestTemplate) -> bytes:
    return template.request.body


def _headers(template: RequestTemplate) -> dict[str, str]:
    return dict(template.request.headers)


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("distribution", ["uniform", "zipf"])
def test_every_scenario_builds(scenario: str, distribution: str) -> None:
    context = ScenarioContext(**{**CONTEXT.__dict__, "distribution": distribution})
    templates = build_requests(scenario, 16, context, seed=1)
    assert templates
    for template in templates:
        assert template.request.wire.endswith(template.request.body)
        assert template.ids in (0, 16)


def test_binary_lookup_body_is_little_endian_ids_in_range() -> None:
    templates = build_requests("binary", 100, CONTEXT, seed=2)
    for template in templates:
        assert template.request.path == "/v1/tables/t/lookup"
        assert _headers(template)["Content-Type"] == "application/octet-stream"
        ids = np.frombuffer(_body(template), dtype="<i8")
        assert ids.size == 100 == template.ids == template.rows
        assert ids.min() >= 0 and ids.max() < CONTEXT.num_ids


def test_json_and_pooled_bodies() -> None:
    (json_template, *_) = build_requests("json", 10, CONTEXT, seed=3)
    payload = orjson.loads(_body(json_template))
    assert len(payload["ids"]) == 10 and json_template.rows == 10
    (pooled, *_) = build_requests("pooled", 10, CONTEXT, seed=3)
    payload = orjson.loads(_body(pooled))
    assert payload["offsets"] == [0, 4, 8] and payload["pooling"] == "sum"
    assert pooled.ids == 10 and pooled.rows == 3  # three bags of at most 4 ids


def test_multi_table_body_splits_ids_over_tables() -> None:
    (template, *_) = build_requests("multi", 10, CONTEXT, seed=4)
    assert template.request.path == "/v1/lookup"
    lookups = orjson.loads(_body(template))["lookups"]
    assert [item["table"] for item in lookups] == ["t", "u", "v"]
    assert [len(item["ids"]) for item in lookups] == [4, 3, 3]


def test_update_body_is_ids_then_gradients() -> None:
    (template, *_) = build_requests("update", 5, CONTEXT, seed=5)
    assert template.request.path == "/v1/tables/t/update"
    assert _headers(template)["X-Robez-Shape"] == f"5,{DIM}"
    body = _body(template)
    assert len(body) == 5 * 8 + 5 * DIM * 4
    grads = np.frombuffer(body, dtype="<f4", offset=40)
    assert np.isfinite(grads).all() and np.abs(grads).max() < 0.01
    assert template.kind == "update" and template.rows == 0


def _step_parts(template: RequestTemplate, counts: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """A step body's pushed ids (gradients checked on the way) and its lookup part's ids."""
    body, offset, pushed = _body(template), 0, []
    for count in counts:
        pushed.append(np.frombuffer(body, dtype="<i8", count=count, offset=offset))
        grads = np.frombuffer(body, dtype="<f4", count=count * DIM, offset=offset + count * 8)
        assert np.isfinite(grads).all() and np.abs(grads).max() < 0.01
        offset += count * (8 + DIM * 4)
    return np.concatenate(pushed), np.frombuffer(body, dtype="<i8", offset=offset)


def test_step_is_a_multi_table_push_with_the_next_batch_as_its_lookup_part() -> None:
    templates = build_requests("step", 10, CONTEXT, seed=7)
    fresh = 0
    for template in templates:
        headers = _headers(template)
        assert template.request.path == "/v1/update" and template.kind == "update"
        assert headers["X-Robez-Tables"] == "t=4,u=3,v=3" == headers["X-Robez-Lookup"]
        assert headers["X-Robez-Shapes"] == f"4,{DIM};3,{DIM};3,{DIM}"
        pushed, next_ids = _step_parts(template, (4, 3, 3))
        assert pushed.size == next_ids.size == 10 == template.ids == template.rows
        assert min(pushed.min(), next_ids.min()) >= 0
        assert max(pushed.max(), next_ids.max()) < CONTEXT.num_ids
        fresh += not np.array_equal(pushed, next_ids)
    assert fresh  # the next batch is drawn afresh, not the pushed batch again


def test_check_step_response() -> None:
    (template, *_) = build_requests("step", 5, CONTEXT, seed=0)
    headers = {"x-robez-shapes": f"2,{DIM};2,{DIM};1,{DIM}", "x-robez-lookup-version": "3,1,1"}
    assert check_response(template, Response(200, headers, bytes(5 * DIM * 4)), DIM) is None
    assert check_response(template, Response(200, headers, bytes(4 * DIM * 4)), DIM) is not None
    unanswered = {"x-robez-shapes": headers["x-robez-shapes"]}
    assert check_response(template, Response(200, unanswered, bytes(5 * DIM * 4)), DIM) is not None
    two_parts = {**headers, "x-robez-shapes": f"3,{DIM};2,{DIM}"}
    assert check_response(template, Response(200, two_parts, bytes(5 * DIM * 4)), DIM) is not None


def test_mix_is_exactly_one_update_in_twenty() -> None:
    templates = build_requests("mix", 32, CONTEXT, seed=6)
    kinds = [t.kind for t in templates]
    assert len(kinds) == 20 and kinds.count("update") == 1 and kinds.count("lookup") == 19


def test_api_key_is_sent_as_bearer() -> None:
    context = ScenarioContext(**{**CONTEXT.__dict__, "api_key": "s3cret"})
    for scenario in ("binary", "update"):
        (template, *_) = build_requests(scenario, 2, context, seed=0)
        assert _headers(template)["Authorization"] == "Bearer s3cret"


@pytest.mark.parametrize(("scenario", "batch"), [("nope", 1), ("binary", 0), ("binary", 32769)])
def test_bad_scenario_or_batch_is_refused(scenario: str, batch: int) -> None:
    with pytest.raises(ValueError):
        build_requests(scenario, batch, CONTEXT, seed=0)


def test_check_binary_response() -> None:
    (template, *_) = build_requests("binary", 3, CONTEXT, seed=0)
    good = Response(200, {"x-robez-shape": f"3,{DIM}"}, bytes(3 * DIM * 4))
    assert check_response(template, good, DIM) is None
    short = Response(200, {"x-robez-shape": f"3,{DIM}"}, bytes(3 * DIM * 4 - 4))
    assert check_response(template, short, DIM) is not None
    wrong_shape = Response(200, {"x-robez-shape": f"{DIM},3"}, bytes(3 * DIM * 4))
    assert check_response(template, wrong_shape, DIM) is not None


def test_check_json_and_multi_responses() -> None:
    (json_template, *_) = build_requests("json", 2, CONTEXT, seed=0)
    right, wrong = orjson.dumps({"shape": [2, DIM]}), orjson.dumps({"shape": [1, DIM]})
    assert check_response(json_template, Response(200, {}, right), DIM) is None
    assert check_response(json_template, Response(200, {}, wrong), DIM) is not None
    assert check_response(json_template, Response(200, {}, b"<html>"), DIM) is not None
    (multi, *_) = build_requests("multi", 5, CONTEXT, seed=0)
    results = {"results": [{"shape": [2, DIM]}, {"shape": [2, DIM]}, {"shape": [1, DIM]}]}
    assert check_response(multi, Response(200, {}, orjson.dumps(results)), DIM) is None
    results["results"].pop()
    assert check_response(multi, Response(200, {}, orjson.dumps(results)), DIM) is not None


def test_oip_body_frames_binary_ids_and_asks_for_binary_rows() -> None:
    (template, *_) = build_requests("oip", 5, CONTEXT, seed=4)
    assert template.request.path == "/v2/models/t/infer"
    length = int(_headers(template)["Inference-Header-Content-Length"])
    header = orjson.loads(_body(template)[:length])
    assert header["inputs"][0] == {
        "name": "ids",
        "shape": [5],
        "datatype": "INT64",
        "parameters": {"binary_data_size": 40},
    }
    assert header["parameters"] == {"binary_data_output": True}
    ids = np.frombuffer(_body(template)[length:], dtype="<i8")
    assert ids.size == 5 and ids.min() >= 0 and ids.max() < CONTEXT.num_ids
    reply_header = orjson.dumps({"outputs": [{"name": "embeddings", "shape": [5, DIM]}]})
    good = Response(
        200, {"inference-header-content-length": str(len(reply_header))}, reply_header + bytes(5 * DIM * 4)
    )
    assert check_response(template, good, DIM) is None
    short = Response(200, good.headers, good.body[:-4])
    assert "bytes" in (check_response(template, short, DIM) or "")
    unframed = Response(200, {}, good.body)
    assert "frame" in (check_response(template, unframed, DIM) or "")


def test_redis_commands_hold_the_ids_and_rows() -> None:
    (get,) = build_requests("redis", 1, CONTEXT, seed=5)[:1]
    assert get.request.wire.startswith(b"*2\r\n$3\r\nGET\r\n") and get.kind == "peer"
    (mget, *_) = build_requests("redis", 3, CONTEXT, seed=5)
    assert mget.request.wire.startswith(b"*4\r\n$4\r\nMGET\r\n") and mget.request.wire.count(b"robez:") == 3
    assert check_response(mget, Response(200, {}, bytes(3 * DIM * 4)), DIM) is None
    assert check_response(mget, Response(200, {}, bytes(2 * DIM * 4)), DIM) is not None
    (mset, *_) = build_requests(PEER_UPDATE, 2, CONTEXT, seed=6)
    assert mset.request.wire.startswith(b"*5\r\n$4\r\nMSET\r\n") and mset.ids == 2 and mset.rows == 0
    assert f"${DIM * 4}\r\n".encode() in mset.request.wire


def test_floor_is_a_get_of_the_root() -> None:
    (template,) = build_requests("floor", 1, CONTEXT, seed=0)
    assert template.request.wire.startswith(b"GET / HTTP/1.1\r\n") and template.kind == "healthz"


def test_floor_rows_sends_the_binary_lookup_to_the_floor() -> None:
    floor = build_requests(FLOOR_ROWS, 5, CONTEXT, seed=3)
    lookup = build_requests("binary", 5, CONTEXT, seed=3)
    assert [t.request.body for t in floor] == [t.request.body for t in lookup]  # the same ids
    template = floor[0]
    assert template.request.wire.startswith(f"POST /rows/5/{DIM} HTTP/1.1\r\n".encode())
    assert (template.kind, template.ids, template.rows, template.response) == ("floor", 5, 5, "binary")
    answer = Response(200, {"x-robez-shape": f"5,{DIM}"}, bytes(5 * DIM * 4))
    assert check_response(template, answer, DIM) is None
