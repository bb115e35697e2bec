"""``RemoteEmbeddingBagCollection``'s batched paths: every table's distinct ids in one compiled pass
(``robez_core.kernels.distinct_by_table``), one pooling op and one gradient gather for all features of
one dim; and the odd cases they must still get right (ids a table does not hold with
``validate_ids=False``, tables of 2**62 ids, features of one server table apart, mixed dims). Bit for bit
the local collection on a server, and what a feature-by-feature reference sends against a fake one."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from torch import Tensor, nn

from robez_core import EmbeddingBagConfig, OptimizerConfig, RobezEmbeddingBagCollection
from service.client import RemoteEmbeddingBagCollection, RobezClient

from .conftest import store_of

MEMORY_SIZE = 1 << 12
CHUNK_SIZE = 4
ADAGRAD = OptimizerConfig("adagrad", lr=0.05)
# One dim for every feature: the batched pooling and gradient paths; a table of two features, mean and sum.
TABLES = [
    EmbeddingBagConfig("t0", 300, 8, ["f0"]),
    EmbeddingBagConfig("t1", 2000, 8, ["f1", "f2"], pooling="mean"),
    EmbeddingBagConfig("t2", 50, 8, ["f3"], pooling="mean"),
]
KEYS = ["f0", "f1", "f2", "f3"]


def jagged(
    seed: int, sizes: dict[str, int], batch: int, *, one_id: bool, keys: list[str]
) -> dict[str, Tensor]:
    """keys/values/lengths, key by key in ``keys`` order: bags of 0-3 ids (Zipf-ish, repeats), or one id each;
    ``f3`` has no ids at all in odd batches (a table the step does not touch)."""
    generator = torch.Generator().manual_seed(seed)
    values, lengths = [], []
    for key in keys:
        counts = (
            torch.ones(batch, dtype=torch.int64)
            if one_id
            else torch.randint(0, 4, (batch,), generator=generator)
        )
        if key == "f3" and seed % 2 and not one_id:
            counts = torch.zeros_like(counts)
        values.append((torch.rand(int(counts.sum()), generator=generator) ** 3 * sizes[key]).long())
        lengths.append(counts)
    return {"keys": keys, "values": torch.cat(values), "lengths": torch.cat(lengths)}


@pytest.mark.parametrize("one_id", [False, True], ids=["jagged", "one id a bag"])
def test_batched_paths_train_the_local_collections_bits(
    client_factory: Callable[..., TestClient], one_id: bool
) -> None:
    app = client_factory()
    client = RobezClient(http_client=app)
    RemoteEmbeddingBagCollection.create_tables(
        client, TABLES, memory_size=MEMORY_SIZE, optimizer=ADAGRAD, chunk_size=CHUNK_SIZE
    )
    local = RobezEmbeddingBagCollection(TABLES, MEMORY_SIZE, chunk_size=CHUNK_SIZE, optimizer=ADAGRAD)
    sizes = {"f0": 300, "f1": 2000, "f2": 2000, "f3": 50}
    torch.manual_seed(0)
    heads = [nn.Linear(32, 1) for _ in range(2)]
    heads[1].load_state_dict(heads[0].state_dict())
    with RemoteEmbeddingBagCollection(client, TABLES) as remote:
        shuffled = jagged(9, sizes, 16, one_id=one_id, keys=["f2", "f0", "f3", "f1"])
        with torch.no_grad():  # keys in any order in, the collection's order out
            assert torch.equal(remote(**shuffled).values(), local(**shuffled).values())
        # (Trained with keys out of order, remote and local part: the push goes table by table in the
        # collection's order, the local step sums a location's gradients in the keys' order.)
        for step in range(3):
            batch = jagged(step, sizes, 16, one_id=one_id, keys=KEYS)
            outputs = []
            for ebc, mlp in ((remote, heads[0]), (local, heads[1])):
                pooled = ebc(**batch).values()
                (mlp(pooled) ** 2).sum().backward()  # one push for the remote one
                outputs.append(pooled.detach())
            assert torch.equal(outputs[0], outputs[1]), step
        with torch.no_grad():  # every bag empty: zeros, and nothing else sent but an empty pull
            empty = {
                "keys": KEYS,
                "values": torch.zeros(0, dtype=torch.int64),
                "lengths": torch.zeros(64, dtype=torch.int64),
            }
            assert torch.equal(remote(**empty).values(), torch.zeros(16, 32))
    state = store_of(app).table("t0").tensors()
    assert torch.equal(state["weight"], local.weight.detach())
    for name, tensor in local.optimizer_state.items():
        assert torch.equal(state[f"state.{name}"], tensor), name
    assert remote.versions == {"t0": 3, "t1": 3, "t2": 3}


class FakeServer:
    """Answers ``POST /v1/lookup`` with rows that are a function of (table, id) (multiples of 1/8: sums
    exact in any order) and records every push."""

    def __init__(self, dims: dict[str, int]) -> None:
        self.dims = dims
        self.lookups: list[dict[str, list[int]]] = []  # each pull's {table: ids}
        self.pushes: list[httpx.Request] = []

    @staticmethod
    def row(table: str, ident: int, dim: int) -> Tensor:
        return (torch.arange(dim, dtype=torch.float32) + (ident % 97) + 3 * len(table)) / 8

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/update":
            self.pushes.append(request)
            names = [part.split("=")[0] for part in request.headers["X-Robez-Tables"].split(",")]
            return httpx.Response(200, json={"results": [{"table": n, "version": 1} for n in names]})
        ids = np.frombuffer(request.content, dtype="<i8").tolist()
        asked, start, rows, shapes = {}, 0, [], []
        for part in request.headers["X-Robez-Tables"].split(","):
            name, count = part.split("=")
            asked[name] = ids[start : start + int(count)]
            start += int(count)
            dim = self.dims[name]
            rows += [self.row(name, ident, dim) for ident in asked[name]]
            shapes.append(f"{count},{dim}")
        self.lookups.append(asked)
        body = torch.cat(rows).numpy().tobytes() if rows else b""
        return httpx.Response(200, content=body, headers={"X-Robez-Shapes": ";".join(shapes)})


def reference(
    tables: list[EmbeddingBagConfig], names: dict[str, str], batch: dict[str, Tensor], grad: Tensor
) -> tuple[dict[str, list[int]], Tensor, bytes]:
    """Feature by feature, bag by bag: the pull's ids, the pooled output and the push's body."""
    size = batch["lengths"].numel() // len(batch["keys"])
    bags, start = {}, 0
    for index, key in enumerate(batch["keys"]):
        lengths = batch["lengths"][index * size : (index + 1) * size].tolist()
        bags[key] = []
        for length in lengths:
            bags[key].append(batch["values"][start : start + length].tolist())
            start += length
    pulls: dict[str, list[int]] = {}
    pushes: dict[str, tuple[list[int], list[Tensor]]] = {}
    columns, column = [], 0
    for table in tables:
        server = names.get(table.name, table.name)
        for key in table.feature_names:
            pulls[server] = sorted(set(pulls.get(server, [])) | {i for bag in bags[key] for i in bag})
            pooled = torch.zeros(size, table.embedding_dim)
            ids, grads = pushes.setdefault(server, ([], []))
            for b, bag in enumerate(bags[key]):
                for ident in bag:
                    pooled[b] = pooled[b] + FakeServer.row(server, ident, table.embedding_dim)
                    gradient = grad[b, column : column + table.embedding_dim]
                    ids.append(ident)
                    grads.append(gradient / float(len(bag)) if table.pooling == "mean" else gradient)
                if table.pooling == "mean":
                    pooled[b] = pooled[b] * (1.0 / torch.tensor(float(max(len(bag), 1))))
            columns.append(pooled)
            column += table.embedding_dim
    body = b"".join(
        np.asarray(ids, dtype="<i8").tobytes() + torch.stack(grads).numpy().astype("<f4").tobytes()
        for ids, grads in pushes.values()
        if ids
    )
    return pulls, torch.cat(columns, dim=1), body


HUGE = 1 << 62
CASES = {
    # f0 and f2 read one server table "x" with f1 ("y") between them: its ids and gradients in two runs
    "one table's features apart": (
        [
            EmbeddingBagConfig("a", 40, 4, ["f0"]),
            EmbeddingBagConfig("b", 30, 4, ["f1"], pooling="mean"),
            EmbeddingBagConfig("c", 40, 4, ["f2"], pooling="mean"),
        ],
        {"a": "x", "b": "y", "c": "x"},
        True,
    ),
    # tables of 2**62 ids each (more than int64 holds together)
    "tables of 2**62 ids": (
        [
            EmbeddingBagConfig("a", HUGE, 4, ["f0"]),
            EmbeddingBagConfig("b", HUGE, 4, ["f1", "f2"], pooling="mean"),
        ],
        {},
        True,
    ),
    # validate_ids=False: an id past its table's end goes to that table (the server answers it), not
    # to another's; mixed dims (one pooling op per feature)
    "ids a table does not hold, mixed dims": (
        [
            EmbeddingBagConfig("a", 40, 4, ["f0"]),
            EmbeddingBagConfig("b", 30, 2, ["f1", "f2"], pooling="mean"),
        ],
        {},
        False,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_odd_cases_send_and_pool_what_a_feature_by_feature_reference_does(case: str) -> None:
    tables, names, validate = CASES[case]
    dims = {names.get(t.name, t.name): t.embedding_dim for t in tables}
    fake = FakeServer(dims)
    client = RobezClient("http://robez.test", transport=httpx.MockTransport(fake))
    keys = ["f2", "f1", "f0"]
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 4, (3 * 5,), generator=generator)
    values = torch.randint(0, 30, (int(lengths.sum()),), generator=generator)
    if not validate:
        values[-1] = 45  # f0's last id, past "a"'s 40 rows (and past "b"'s 30)
    batch = {"keys": keys, "values": values, "lengths": lengths}
    with RemoteEmbeddingBagCollection(client, tables, table_names=names, validate_ids=validate) as ebc:
        pooled = ebc(**batch).values()
        grad = torch.randn(pooled.shape, generator=generator)
        pooled.backward(grad)
    pulls, want_pooled, want_body = reference(tables, names, batch, grad)
    (asked,) = fake.lookups  # each table's distinct ids, in order of first appearance
    assert {name: sorted(ids) for name, ids in asked.items()} == pulls
    assert torch.equal(pooled.detach(), want_pooled)
    (push,) = fake.pushes
    assert push.content == want_body
    if not validate:
        assert 45 in pulls["a"]
