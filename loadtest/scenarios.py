"""What a load-test run sends: the scenarios, as pools of pre-encoded requests.

Every request body is built before the clock starts (a small pool of distinct bodies, reused round
robin), so the client's per-request work is a socket write and a response check, and the server sees
fresh ids without the client paying numpy time in the measured loop.

Scenarios (``SCENARIOS``):

- ``healthz``  GET /healthz, the HTTP floor: the same server's cheapest endpoint.
- ``binary``   POST /v1/tables/{t}/lookup, little-endian int64 ids -> float32 rows (X-Robez-Shape).
- ``json``     the same lookup as JSON ``{"ids": [...]}`` -> ``{"shape", "embeddings", ...}``.
- ``pooled``   JSON lookup with ``offsets`` and ``pooling="sum"``: batch ids in bags of ``bag_size``.
- ``multi``    POST /v1/lookup, the batch split over several tables in one request (a DLRM request).
- ``update``   POST /v1/tables/{t}/update, binary: n int64 ids then n x d float32 gradients.
- ``mix``      95% binary lookups, 5% binary updates of the same batch size (exactly 1 in 20).
- ``step``     one training step in one request (a DLRM trainer's, ``RemoteEmbeddingBagCollection``'s):
               POST /v1/update, binary, the batch's gradients split over several tables (as ``multi``
               splits its ids) with a lookup part holding the next batch's ids over the same tables,
               answered with their rows after the push is applied.
- ``oip``      POST /v2/models/{t}/infer (Open Inference Protocol v2), binary tensor data both ways.
- ``grpc``     the same inference over gRPC (``GRPCInferenceService/ModelInfer``, raw_input_contents and
               raw_output_contents), sent with the ``grpc`` transport to ``ScenarioContext.grpc_target``.
- ``floor``    GET / on a bare Starlette app (one route returning "ok") under the same uvicorn: the
               framework floor the small-request scenarios are compared with. With it the sweep also
               runs ``floor_rows``: the binary lookup's request sent to the same app's
               ``POST /rows/{n}/{d}``, which answers n x d precomputed float32 bytes with the lookup's
               headers (the framework's cost of a large answer, without the kernel).
- ``redis``    the peer: a Redis server holding one full row per id (float32 bytes); GET for one id,
               MGET for a batch (``redis_set``: SET / MSET of new rows, the update counterpart).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import orjson

from .stats import make_sampler
from .transport import PreparedRequest, Response, Target, prepare_request, resp_command

SCENARIOS: tuple[str, ...] = (
    "healthz",
    "binary",
    "json",
    "pooled",
    "multi",
    "update",
    "mix",
    "step",
    "oip",
    "grpc",
    "floor",
    "redis",
)
# Built for the Redis peer's update runs (chosen with "redis"), not named on the command line.
PEER_UPDATE = "redis_set"
# The framework floor answering a binary lookup's bytes (run with "floor"), not named on the command line.
FLOOR_ROWS = "floor_rows"
REDIS_KEY_PREFIX = b"robez:"
OCTET_STREAM = "application/octet-stream"
SHAPE_HEADER = "X-Robez-Shape"
MAX_BATCH_SIZE = 32768
# Pools hold at most this many body bytes; big update bodies (n x d floats) get fewer distinct copies.
_POOL_BYTES = 48 << 20
_POOL_MAX = 32
_MIX_PERIOD = 20  # 1 update in every 20 requests: the 95/5 mix
# Gradients small enough that thousands of updates leave the table's values near their init scale.
_GRAD_SCALE = 1e-4


@dataclass(frozen=True)
class ScenarioContext:
    """Everything a scenario needs to know about the server and the ids it should send.

    ``tables`` lists the tables the multi-table scenario spreads its batch over; ``table`` is the one
    the single-table scenarios use. ``embedding_dim`` must be the server's d for ``table`` (the runner
    reads it from a one-id lookup), every table in ``tables`` included.
    """

    target: Target
    table: str
    tables: tuple[str, ...]
    embedding_dim: int
    distribution: str = "uniform"
    num_ids: int = 1_000_000
    zipf_exponent: float = 1.05
    bag_size: int = 32
    api_key: str | None = None
    grpc_target: Target | None = None  # the server's gRPC port, for the grpc scenario


@dataclass(frozen=True)
class RequestTemplate:
    """One pre-encoded request and what a correct answer to it looks like.

    ``ids`` counts the ids sent; ``rows`` the embedding rows the response carries (n for a lookup, the
    number of bags for a pooled one, 0 for updates and /healthz); ``response`` is how to check it.
    """

    request: PreparedRequest
    # "lookup" | "update" | "healthz"; no Server-Timing read: "peer" (Redis), "floor" (/rows), "grpc"
    kind: str
    ids: int  # a step's: the pushed ids (its lookup part's ids are its rows)
    rows: int
    # "binary" | "json" | "multi" | "status" | "oip" | "grpc" | "rows" (bytes of rows only) | "step"
    response: str


def build_requests(
    scenario: str, batch_size: int, context: ScenarioContext, seed: int
) -> list[RequestTemplate]:
    """The request pool for one client process of one run, in the order it is to be sent (round robin).

    Raises:
        ValueError: unknown scenario, or a batch size outside ``[1, MAX_BATCH_SIZE]``.
    """
    if scenario not in SCENARIOS and scenario not in (PEER_UPDATE, FLOOR_ROWS):
        raise ValueError(f"unknown scenario {scenario!r}; expected one of {SCENARIOS}")
    if not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise ValueError(f"batch size must be in [1, {MAX_BATCH_SIZE}], got {batch_size}")
    if scenario in ("healthz", "floor"):
        path = "/healthz" if scenario == "healthz" else "/"
        return [RequestTemplate(prepare_request(context.target, "GET", path), "healthz", 0, 0, "status")]
    sampler = make_sampler(context.distribution, context.num_ids, context.zipf_exponent, seed)
    rng = np.random.default_rng(seed + 1)
    writes = scenario in ("update", "mix", "step", PEER_UPDATE)
    per_body_bytes = batch_size * 8 * (1 + (context.embedding_dim if writes else 0) + (scenario == "step"))
    pool_size = max(2, min(_POOL_MAX, _POOL_BYTES // max(1, per_body_bytes)))
    if scenario == "mix":
        pool_size = _MIX_PERIOD
    templates: list[RequestTemplate] = []
    for index in range(pool_size):
        ids = sampler.sample(batch_size)
        if scenario == "binary" or (scenario == "mix" and index != 0):
            templates.append(_binary_lookup(context, ids))
        elif scenario == FLOOR_ROWS:
            templates.append(_floor_rows(context, ids))
        elif scenario == "json":
            templates.append(_json_lookup(context, ids))
        elif scenario == "pooled":
            templates.append(_pooled_lookup(context, ids))
        elif scenario == "multi":
            templates.append(_multi_lookup(context, ids))
        elif scenario == "oip":
            templates.append(_oip_infer(context, ids))
        elif scenario == "grpc":
            templates.append(_grpc_infer(context, ids))
        elif scenario == "redis":
            templates.append(_redis_get(context, ids))
        elif scenario == PEER_UPDATE:
            templates.append(_redis_set(context, ids, rng))
        elif scenario == "step":
            templates.append(_training_step(context, ids, sampler.sample(batch_size), rng))
        else:  # update, or the one update in every mix period
            templates.append(_binary_update(context, ids, rng))
    if scenario == "mix":
        # the update's position within the period is random, the 1-in-20 fraction exact
        order = rng.permutation(pool_size)
        templates = [templates[int(i)] for i in order]
    return templates


def _auth(context: ScenarioContext) -> dict[str, str]:
    return {"Authorization": f"Bearer {context.api_key}"} if context.api_key else {}


def _table_path(table: str, action: str) -> str:
    return f"/v1/tables/{table}/{action}"


def _binary_lookup(context: ScenarioContext, ids: np.ndarray) -> RequestTemplate:
    headers = {"Content-Type": OCTET_STREAM, "Accept": OCTET_STREAM, **_auth(context)}
    body = ids.astype("<i8").tobytes()
    request = prepare_request(context.target, "POST", _table_path(context.table, "lookup"), body, headers)
    return RequestTemplate(request, "lookup", ids.size, ids.size, "binary")


def _floor_rows(context: ScenarioContext, ids: np.ndarray) -> RequestTemplate:
    """The binary lookup's request and expected answer, sent to the framework floor's ``/rows`` route."""
    headers = {"Content-Type": OCTET_STREAM, "Accept": OCTET_STREAM, **_auth(context)}
    body = ids.astype("<i8").tobytes()
    path = f"/rows/{ids.size}/{context.embedding_dim}"
    return RequestTemplate(
        prepare_request(context.target, "POST", path, body, headers), "floor", ids.size, ids.size, "binary"
    )


def _json_lookup(context: ScenarioContext, ids: np.ndarray) -> RequestTemplate:
    headers = {"Content-Type": "application/json", **_auth(context)}
    body = orjson.dumps({"ids": ids.tolist()})
    request = prepare_request(context.target, "POST", _table_path(context.table, "lookup"), body, headers)
    return RequestTemplate(request, "lookup", ids.size, ids.size, "json")


def _pooled_lookup(context: ScenarioContext, ids: np.ndarray) -> RequestTemplate:
    headers = {"Content-Type": "application/json", **_auth(context)}
    offsets = list(range(0, ids.size, context.bag_size))
    body = orjson.dumps({"ids": ids.tolist(), "offsets": offsets, "pooling": "sum"})
    request = prepare_request(context.target, "POST", _table_path(context.table, "lookup"), body, headers)
    return RequestTemplate(request, "lookup", ids.size, len(offsets), "json")


def multi_lookup_body(tables: tuple[str, ...], ids: np.ndarray) -> bytes:
    """``POST /v1/lookup`` body: the ids split as evenly as possible over ``tables`` (in order)."""
    parts = np.array_split(ids, len(tables))
    return orjson.dumps(
        {"lookups": [{"table": t, "ids": p.tolist()} for t, p in zip(tables, parts, strict=True)]}
    )


def _multi_lookup(context: ScenarioContext, ids: np.ndarray) -> RequestTemplate:
    headers = {"Content-Type": "application/json", **_auth(context)}
    body = multi_lookup_body(context.tables, ids)
    request = prepare_request(context.target, "POST", "/v1/lookup", body, headers)
    return RequestTemplate(request, "lookup", ids.size, ids.size, "multi")


def _binary_update(context: ScenarioContext, ids: np.ndarray, rng: np.random.Generator) -> RequestTemplate:
    dim = context.embedding_dim
    grads = (rng.standard_normal((ids.size, dim)) * _GRAD_SCALE).astype("<f4")
    headers = {"Content-Type": OCTET_STREAM, SHAPE_HEADER: f"{ids.size},{dim}", **_auth(context)}
    body = ids.astype("<i8").tobytes() + grads.tobytes()
    request = prepare_request(context.target, "POST", _table_path(context.table, "update"), body, headers)
    return RequestTemplate(request, "update", ids.size, 0, "status")


def _tables_header(tables: tuple[str, ...], parts: list[np.ndarray]) -> str:
    return ",".join(f"{table}={part.size}" for table, part in zip(tables, parts, strict=True))


def _training_step(
    context: ScenarioContext, ids: np.ndarray, next_ids: np.ndarray, rng: np.random.Generator
) -> RequestTemplate:
    """``POST /v1/update``, binary: this batch's gradients over ``tables`` and the next batch's lookup."""
    dim = context.embedding_dim
    pushed = np.array_split(ids, len(context.tables))
    looked_up = np.array_split(next_ids, len(context.tables))
    body = bytearray()
    for part in pushed:
        grads = (rng.standard_normal((part.size, dim)) * _GRAD_SCALE).astype("<f4")
        body += part.astype("<i8").tobytes() + grads.tobytes()
    for part in looked_up:
        body += part.astype("<i8").tobytes()
    headers = {
        "Content-Type": OCTET_STREAM,
        "Accept": OCTET_STREAM,
        "X-Robez-Tables": _tables_header(context.tables, pushed),
        "X-Robez-Shapes": ";".join(f"{part.size},{dim}" for part in pushed),
        "X-Robez-Lookup": _tables_header(context.tables, looked_up),
        **_auth(context),
    }
    request = prepare_request(context.target, "POST", "/v1/update", bytes(body), headers)
    return RequestTemplate(request, "update", ids.size, next_ids.size, "step")


def _check_step(template: RequestTemplate, response: Response, embedding_dim: int) -> str | None:
    expected = template.rows * embedding_dim * 4
    if len(response.body) != expected:
        return f"step answer {len(response.body)} bytes, expected {expected} (the lookup part's rows)"
    shapes = response.headers.get("x-robez-shapes", "").replace(" ", "").split(";")
    try:
        rows = sum(int(shape.split(",")[0]) for shape in shapes if shape.endswith(f",{embedding_dim}"))
    except ValueError:
        return f"X-Robez-Shapes {shapes!r} is not m,d;m,d;..."
    parts = len(dict(template.request.headers)["X-Robez-Lookup"].split(","))
    if rows != template.rows or len(shapes) != parts:
        return f"X-Robez-Shapes {shapes!r}: {rows} rows of d {embedding_dim}, expected {template.rows}"
    if not response.headers.get("x-robez-lookup-version"):
        return "no X-Robez-Lookup-Version: the lookup part was not answered"
    return None


OIP_HEADER_LENGTH = "Inference-Header-Content-Length"


def _oip_infer(context: ScenarioContext, ids: np.ndarray) -> RequestTemplate:
    """Binary tensors both ways, as Triton's clients send them by default."""
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "ids",
                    "shape": [int(ids.size)],
                    "datatype": "INT64",
                    "parameters": {"binary_data_size": int(ids.size) * 8},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    )
    headers = {OIP_HEADER_LENGTH: str(len(header)), **_auth(context)}
    body = header + ids.astype("<i8").tobytes()
    request = prepare_request(context.target, "POST", f"/v2/models/{context.table}/infer", body, headers)
    return RequestTemplate(request, "lookup", ids.size, ids.size, "oip")


GRPC_INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"


def _grpc_infer(context: ScenarioContext, ids: np.ndarray) -> RequestTemplate:
    """The ``oip`` request over gRPC: the ids as raw_input_contents, as Triton's gRPC client sends them."""
    from tritonclient.grpc import service_pb2

    message = service_pb2.ModelInferRequest(model_name=context.table)
    message.inputs.add(name="ids", datatype="INT64", shape=[int(ids.size)])
    message.raw_input_contents.append(ids.astype("<i8").tobytes())
    metadata = tuple(_auth(context).items())
    body = message.SerializeToString()
    request = PreparedRequest("GRPC", GRPC_INFER_METHOD, metadata, body, body)  # the message is the wire
    return RequestTemplate(request, "grpc", ids.size, ids.size, "grpc")


def _check_grpc(template: RequestTemplate, response: Response, embedding_dim: int) -> str | None:
    from google.protobuf.message import DecodeError
    from tritonclient.grpc import service_pb2

    try:
        message = service_pb2.ModelInferResponse.FromString(bytes(response.body))
    except DecodeError:
        return "the gRPC answer is not a ModelInferResponse"
    if len(message.outputs) != 1 or list(message.outputs[0].shape) != [template.rows, embedding_dim]:
        shapes = [list(output.shape) for output in message.outputs]
        return f"gRPC outputs {shapes}, expected [{template.rows}, {embedding_dim}]"
    expected = template.rows * embedding_dim * 4
    raw = message.raw_output_contents
    if len(raw) != 1 or len(raw[0]) != expected:
        return f"gRPC raw_output_contents {[len(r) for r in raw]} bytes, expected [{expected}]"
    return None


def redis_key(row_id: int) -> bytes:
    return REDIS_KEY_PREFIX + str(row_id).encode()


def _resp_request(command: bytes, wire: bytes) -> PreparedRequest:
    return PreparedRequest(command.decode(), "", (), b"", wire)


def _redis_get(context: ScenarioContext, ids: np.ndarray) -> RequestTemplate:
    keys = [redis_key(int(i)) for i in ids]
    command = b"GET" if len(keys) == 1 else b"MGET"
    request = _resp_request(command, resp_command(command, *keys))
    return RequestTemplate(request, "peer", ids.size, ids.size, "rows")


def _redis_set(context: ScenarioContext, ids: np.ndarray, rng: np.random.Generator) -> RequestTemplate:
    rows = (rng.standard_normal((ids.size, context.embedding_dim)) * _GRAD_SCALE).astype("<f4")
    parts: list[bytes] = []
    for row_id, row in zip(ids, rows, strict=True):
        parts += [redis_key(int(row_id)), row.tobytes()]
    command = b"SET" if ids.size == 1 else b"MSET"
    request = _resp_request(command, resp_command(command, *parts))
    return RequestTemplate(request, "peer", ids.size, 0, "status")


def check_response(template: RequestTemplate, response: Response, embedding_dim: int) -> str | None:
    """None when ``response`` is a correct answer to ``template``, else a short reason (an error kind).

    Only 2xx answers reach this check; it verifies the shape the scenario promises, not the values.
    """
    if template.response == "status":
        return None
    if template.response == "rows":
        expected = template.rows * embedding_dim * 4
        return (
            None
            if len(response.body) == expected
            else f"rows {len(response.body)} bytes, expected {expected}"
        )
    if template.response == "oip":
        return _check_oip(template, response, embedding_dim)
    if template.response == "grpc":
        return _check_grpc(template, response, embedding_dim)
    if template.response == "step":
        return _check_step(template, response, embedding_dim)
    if template.response == "binary":
        expected = template.rows * embedding_dim * 4
        if len(response.body) != expected:
            return f"binary body {len(response.body)} bytes, expected {expected}"
        shape = response.headers.get(SHAPE_HEADER.lower(), "")
        if shape.replace(" ", "") != f"{template.rows},{embedding_dim}":
            return f"X-Robez-Shape {shape!r}, expected {template.rows},{embedding_dim}"
        return None
    try:
        payload = orjson.loads(response.body)
    except orjson.JSONDecodeError:
        return "response is not JSON"
    if template.response == "json":
        return _check_shape(payload, template.rows, embedding_dim)
    results = payload.get("results") if isinstance(payload, dict) else None
    if not isinstance(results, list):
        return "multi-table response has no 'results' list"
    rows = 0
    for item in results:
        item_shape = item.get("shape") if isinstance(item, dict) else None
        if not (isinstance(item_shape, list) and len(item_shape) == 2 and item_shape[1] == embedding_dim):
            return f"multi-table result shape {item_shape!r}"
        rows += int(item_shape[0])
    return None if rows == template.rows else f"multi-table rows {rows}, expected {template.rows}"


def _check_shape(payload: object, rows: int, embedding_dim: int) -> str | None:
    shape = payload.get("shape") if isinstance(payload, dict) else None
    if shape != [rows, embedding_dim]:
        return f"JSON shape {shape!r}, expected [{rows}, {embedding_dim}]"
    return None


def _check_oip(template: RequestTemplate, response: Response, embedding_dim: int) -> str | None:
    length = response.headers.get(OIP_HEADER_LENGTH.lower(), "")
    if not length.isdigit() or int(length) > len(response.body):
        return f"{OIP_HEADER_LENGTH} {length!r} does not frame the body"
    try:
        header = orjson.loads(response.body[: int(length)])
        shape = header["outputs"][0]["shape"]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        return "the OIP response header has no outputs[0].shape"
    if shape != [template.rows, embedding_dim]:
        return f"OIP shape {shape!r}, expected [{template.rows}, {embedding_dim}]"
    expected = template.rows * embedding_dim * 4
    if len(response.body) - int(length) != expected:
        return f"OIP tensor {len(response.body) - int(length)} bytes, expected {expected}"
    return None
