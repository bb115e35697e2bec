"""KServe's own v2 clients (``kserve`` 0.21: ``InferenceRESTClient`` with protocol v2,
``InferenceGRPCClient``) against a running robez, on their default settings: readiness, metadata and one
inference each, the rows compared with ``/v1``'s. Run by ``make compat-test`` (devtools/compat/run.sh),
which installs kserve into a private folder; exits 1 on any failure.

    python -m devtools.compat.kserve_clients --http 127.0.0.1:8000 --grpc 127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import httpx
import numpy as np


def _v1_rows(http: str, ids: np.ndarray) -> np.ndarray:
    reply = httpx.post(
        f"http://{http}/v1/tables/demo/lookup",
        content=ids.astype("<i8").tobytes(),
        headers={"Content-Type": "application/octet-stream", "Accept": "application/octet-stream"},
        timeout=30,
    )
    reply.raise_for_status()
    return np.frombuffer(reply.content, dtype="<f4").reshape(ids.size, -1)


def _request(ids: np.ndarray) -> Any:
    from kserve import InferInput, InferRequest

    tensor = InferInput(name="ids", shape=[int(ids.size)], datatype="INT64")
    tensor.set_data_from_numpy(ids)
    return InferRequest(model_name="demo", infer_inputs=[tensor], request_id="kserve-1")


async def _check(http: str, grpc_address: str, compare: bool = True) -> list[str]:
    from kserve import InferenceGRPCClient, InferenceRESTClient, RESTConfig

    ids = np.array([3, 1, 4, 1, 5, 9, 2**40], dtype=np.int64)
    expected = _v1_rows(http, ids) if compare else np.zeros(0, np.float32)
    failures = []
    rest = InferenceRESTClient(RESTConfig(protocol="v2"))
    try:
        ready = await rest.is_model_ready(f"http://{http}", "demo")
        response = await rest.infer(f"http://{http}", _request(ids), model_name="demo")
        rows = response.outputs[0].as_numpy()
        print(f"kserve REST v2: ready={ready} rows={rows.shape}", flush=True)
        if not ready or rows.tobytes() != expected.tobytes():
            failures.append("kserve REST: rows differ from /v1's")
    except Exception as exc:
        failures.append(f"kserve REST: {exc!r}")
    finally:
        await rest.close()
    grpc_client = InferenceGRPCClient(grpc_address)
    try:
        ready = await grpc_client.is_model_ready("demo")
        response = await grpc_client.infer(_request(ids))
        rows = response.outputs[0].as_numpy()
        print(f"kserve gRPC: ready={ready} rows={rows.shape}", flush=True)
        if not ready or rows.tobytes() != expected.tobytes():
            failures.append("kserve gRPC: rows differ from /v1's")
    except Exception as exc:
        failures.append(f"kserve gRPC: {exc!r}")
    finally:
        await grpc_client.close()
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", default="127.0.0.1:8000")
    parser.add_argument("--grpc", default="127.0.0.1:8001")
    parser.add_argument("--record", action="store_true", help="against devtools.compat.record: no /v1 call")
    args = parser.parse_args()
    sys.argv = sys.argv[:1]  # importing kserve parses the command line as its model server's
    failures = asyncio.run(_check(args.http, args.grpc, compare=not args.record))
    for failure in failures:
        print("FAIL", failure, file=sys.stderr)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
