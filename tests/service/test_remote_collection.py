"""``RemoteEmbeddingBagCollection`` against the real app in-process (issue 37): two requests a step, the
server's array bit for bit where the local ``RobezEmbeddingBagCollection`` puts it, prefetch and
non-blocking pushes, and bad input refused before anything is applied."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from torch import Tensor, nn

from robez_core import EmbeddingBagConfig, OptimizerConfig, RobezEmbeddingBagCollection
from service.client import RemoteEmbeddingBagCollection, RobezClient, RobezClientError

from .conftest import store_of

MEMORY_SIZE = 1 << 12  # small: features collide in the array, as in a real ROBE-Z model
CHUNK_SIZE = 4
BATCH = 16
TABLES = [
    EmbeddingBagConfig("t0", 300, 8, ["f0"]),
    EmbeddingBagConfig("t1", 2000, 8, ["f1", "f2"], pooling="mean"),  # one table, two features
    EmbeddingBagConfig("t2", 50, 4, ["f3"], pooling="mean"),
]
OPTIMIZERS = [
    OptimizerConfig("sgd", lr=0.1),
    OptimizerConfig("adagrad", lr=0.05),
    OptimizerConfig("adam", lr=0.01),
]


@dataclass
class Batch:
    keys: list[str]
    values: Tensor
    lengths: Tensor
    labels: Tensor


def make_batch(seed: int, batch_size: int = BATCH, *, one_id_bags: bool = False) -> Batch:
    """Jagged, with empty bags and repeated ids (Zipf-ish: small ids more often); ``one_id_bags``: every
    bag holds one id (Criteo's features, the client's column-slice push)."""
    generator = torch.Generator().manual_seed(seed)
    values, lengths = [], []
    for table in TABLES:
        for _ in table.feature_names:
            counts = torch.randint(0, 4, (batch_size,), generator=generator)
            if one_id_bags:
                counts = torch.ones_like(counts)
            ids = (torch.rand(int(counts.sum()), generator=generator) ** 3 * table.num_embeddings).long()
            values.append(ids)
            lengths.append(counts)
    labels = torch.randint(0, 2, (batch_size,), generator=generator).float()
    return Batch(["f0", "f1", "f2", "f3"], torch.cat(values), torch.cat(lengths), labels)


def served(app: TestClient, optimizer: OptimizerConfig) -> RobezClient:
    client = RobezClient(http_client=app)
    RemoteEmbeddingBagCollection.create_tables(
        client, TABLES, memory_size=MEMORY_SIZE, optimizer=optimizer, chunk_size=CHUNK_SIZE
    )
    return client


def local_twin(optimizer: OptimizerConfig) -> RobezEmbeddingBagCollection:
    return RobezEmbeddingBagCollection(TABLES, MEMORY_SIZE, chunk_size=CHUNK_SIZE, optimizer=optimizer)


def head() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(28, 8), nn.ReLU(), nn.Linear(8, 1))


def train_step(ebc: nn.Module, mlp: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> Tensor:
    pooled = ebc(keys=batch.keys, values=batch.values, lengths=batch.lengths)
    loss = nn.functional.binary_cross_entropy_with_logits(mlp(pooled.values()).squeeze(1), batch.labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return pooled.values().detach()


def server_state(app: TestClient) -> dict[str, Tensor]:
    return {key: tensor.clone() for key, tensor in store_of(app).table("t0").tensors().items()}


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
def test_training_through_the_server_is_bit_for_bit_local_training(
    client_factory: Callable[..., TestClient], optimizer: OptimizerConfig
) -> None:
    app = client_factory()
    client = served(app, optimizer)
    local = local_twin(optimizer)
    assert torch.equal(server_state(app)["weight"], local.weight.detach())  # same seed, same array
    remote_mlp, local_mlp = head(), head()
    remote_sgd = torch.optim.SGD(remote_mlp.parameters(), lr=0.1)
    local_sgd = torch.optim.SGD(local_mlp.parameters(), lr=0.1)
    seen: list[httpx.Request] = []
    app.event_hooks["request"].append(seen.append)
    with RemoteEmbeddingBagCollection(client, TABLES) as remote:
        for step in range(4):
            batch = make_batch(step)
            before = len(seen)
            remote_pooled = train_step(remote, remote_mlp, remote_sgd, batch)
            local_pooled = train_step(local, local_mlp, local_sgd, batch)
            assert [r.url.path for r in seen[before:]] == ["/v1/lookup", "/v1/update"]  # 2 requests
            assert torch.equal(remote_pooled, local_pooled), step
    state = server_state(app)
    assert torch.equal(state["weight"], local.weight.detach())
    for name, tensor in local.optimizer_state.items():
        assert torch.equal(state[f"state.{name}"], tensor), name
    assert remote.versions == {"t0": 4, "t1": 4, "t2": 4}
    assert remote.stats.requests == 8


def test_one_id_bags_train_the_same_bits(client_factory: Callable[..., TestClient]) -> None:
    """Bags of one id push each bag's gradient column as the ids' rows (no per-id gather): still the
    local collection's bits, mean pooling included."""
    optimizer = OPTIMIZERS[1]
    app = client_factory()
    local = local_twin(optimizer)
    remote_mlp, local_mlp = head(), head()
    remote_sgd = torch.optim.SGD(remote_mlp.parameters(), lr=0.1)
    local_sgd = torch.optim.SGD(local_mlp.parameters(), lr=0.1)
    with RemoteEmbeddingBagCollection(served(app, optimizer), TABLES) as remote:
        for step in range(3):
            batch = make_batch(step, one_id_bags=True)
            assert torch.equal(
                train_step(remote, remote_mlp, remote_sgd, batch),
                train_step(local, local_mlp, local_sgd, batch),
            )
    assert torch.equal(server_state(app)["weight"], local.weight.detach())


def test_non_blocking_pushes_without_prefetch_train_the_same_bits(
    client_factory: Callable[..., TestClient],
) -> None:
    optimizer = OPTIMIZERS[1]
    blocking_app, pipelined_app = client_factory(), client_factory()
    results = []
    for app, pending in ((blocking_app, 0), (pipelined_app, 2)):
        mlp = head()
        sgd = torch.optim.SGD(mlp.parameters(), lr=0.1)
        with RemoteEmbeddingBagCollection(served(app, optimizer), TABLES, max_pending_pushes=pending) as ebc:
            for step in range(5):
                train_step(ebc, mlp, sgd, make_batch(step))
        results.append(server_state(app)["weight"])
    # A pull is sent after every push already made (one connection, in order): nothing is stale.
    assert torch.equal(results[0], results[1])


def test_prefetch_pulls_the_next_batch_before_this_push(client_factory: Callable[..., TestClient]) -> None:
    app = client_factory()
    client = served(app, OPTIMIZERS[0])
    seen: list[httpx.Request] = []
    app.event_hooks["request"].append(seen.append)
    mlp = head()
    batches = [make_batch(step) for step in range(4)]
    with RemoteEmbeddingBagCollection(client, TABLES) as ebc:
        with torch.no_grad():
            fresh = ebc(keys=batches[1].keys, values=batches[1].values, lengths=batches[1].lengths).values()
        first = len(seen)
        pooled = ebc(keys=batches[0].keys, values=batches[0].values, lengths=batches[0].lengths)
        ebc.prefetch(keys=batches[1].keys, values=batches[1].values, lengths=batches[1].lengths)
        mlp(pooled.values()).sum().backward()  # the push of batch 0
        with torch.no_grad():
            stale = ebc(keys=batches[1].keys, values=batches[1].values, lengths=batches[1].lengths).values()
        # The prefetched rows were read before the push: batch 1 pooled as it was before training.
        assert torch.equal(stale, fresh)
        paths = [r.url.path for r in seen[first:]]
        assert paths == ["/v1/lookup", "/v1/lookup", "/v1/update"]  # batch 1's pull came before the push
        with torch.no_grad():
            after = ebc(keys=batches[1].keys, values=batches[1].values, lengths=batches[1].lengths).values()
        assert not torch.equal(after, fresh)  # a pull after the push sees it
        # A prefetch of another batch than the one that comes is dropped, and the right rows pulled.
        ebc.prefetch(keys=batches[2].keys, values=batches[2].values, lengths=batches[2].lengths)
        with torch.no_grad():
            got = ebc(keys=batches[3].keys, values=batches[3].values, lengths=batches[3].lengths).values()
            want = ebc(keys=batches[3].keys, values=batches[3].values, lengths=batches[3].lengths).values()
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("optimizer", "mode"),
    [(optimizer, "prefetch_after_push") for optimizer in OPTIMIZERS]
    + [(OPTIMIZERS[1], "prefetch_after_push, 1 pending"), (OPTIMIZERS[2], "push_with_next_pull")],
    ids=lambda value: value.name if isinstance(value, OptimizerConfig) else value,
)
def test_one_request_a_step_trains_the_same_bits_as_no_prefetch(
    client_factory: Callable[..., TestClient], optimizer: OptimizerConfig, mode: str
) -> None:
    """``prefetch_after_push``: the next batch's pull goes with this step's push (``update_and_lookup``,
    one request), so the prefetched rows include it: the bits of training without prefetch (the local
    collection's). ``push_with_next_pull``: the push is held until the next forward, which sends it
    with its pull: the same bits, one request a step, without calling ``prefetch``."""
    app = client_factory()
    client = served(app, optimizer)
    seen: list[httpx.Request] = []
    app.event_hooks["request"].append(seen.append)
    local = local_twin(optimizer)
    remote_mlp, local_mlp = head(), head()
    remote_sgd = torch.optim.SGD(remote_mlp.parameters(), lr=0.1)
    local_sgd = torch.optim.SGD(local_mlp.parameters(), lr=0.1)
    batches = [make_batch(step) for step in range(4)]
    hold = mode == "push_with_next_pull"
    with RemoteEmbeddingBagCollection(
        client,
        TABLES,
        max_pending_pushes=1 if "pending" in mode else 0,
        prefetch_after_push=not hold,
        push_with_next_pull=hold,
    ) as remote:
        for step, batch in enumerate(batches):
            pooled = remote(keys=batch.keys, values=batch.values, lengths=batch.lengths)
            if step + 1 < len(batches) and not hold:
                after = batches[step + 1]
                remote.prefetch(keys=after.keys, values=after.values, lengths=after.lengths)
            loss = nn.functional.binary_cross_entropy_with_logits(
                remote_mlp(pooled.values()).squeeze(1), batch.labels
            )
            remote_sgd.zero_grad()
            loss.backward()
            remote_sgd.step()
            assert torch.equal(pooled.values().detach(), train_step(local, local_mlp, local_sgd, batch))
        if hold:  # the last push is held until flush (here: the context manager's exit)
            assert store_of(app).version("t0") == len(batches) - 1
    assert torch.equal(server_state(app)["weight"], local.weight.detach())
    # One request a step: the first pull, then each push carrying the next batch's pull, the last alone.
    assert [r.url.path for r in seen] == ["/v1/lookup"] + ["/v1/update"] * len(batches)
    assert remote.stats.requests == len(batches) + 1
    assert remote.versions == {"t0": 4, "t1": 4, "t2": 4}


def test_a_push_that_carries_a_pull_raises_its_error_and_applies_nothing(
    client_factory: Callable[..., TestClient],
) -> None:
    """A refused push carrying the next pull (NaN gradients): the next forward raises the 422, nothing
    is applied, and the module goes on (a new pull) afterwards."""
    app = client_factory()
    client = served(app, OPTIMIZERS[1])
    before = server_state(app)
    first, second = make_batch(0), make_batch(1)
    with RemoteEmbeddingBagCollection(client, TABLES, prefetch_after_push=True) as ebc:
        pooled = ebc(keys=first.keys, values=first.values, lengths=first.lengths).values()
        ebc.prefetch(keys=second.keys, values=second.values, lengths=second.lengths)
        gradient = torch.ones_like(pooled)
        gradient[:, -1] = float("nan")
        pooled.backward(gradient)  # sent, not waited for
        with pytest.raises(RobezClientError) as caught:
            ebc(keys=second.keys, values=second.values, lengths=second.lengths)
        assert caught.value.status == 422 and "t2" in caught.value.error
        with torch.no_grad():
            again = ebc(keys=second.keys, values=second.values, lengths=second.lengths).values()
    after = server_state(app)
    assert all(torch.equal(after[key], before[key]) for key in before)
    with torch.no_grad():
        assert torch.equal(
            again,
            local_twin(OPTIMIZERS[1])(
                keys=second.keys, values=second.values, lengths=second.lengths
            ).values(),
        )


def test_a_held_push_is_sent_by_flush_and_its_error_raised_once(
    client_factory: Callable[..., TestClient],
) -> None:
    """``push_with_next_pull``: ``backward`` holds the push; ``flush`` sends it alone (and raises its
    error once); without a flush the server has not got it."""
    app = client_factory()
    client = served(app, OPTIMIZERS[0])
    mlp = head()
    batch = make_batch(0)
    ebc = RemoteEmbeddingBagCollection(client, TABLES, push_with_next_pull=True)
    mlp(ebc(keys=batch.keys, values=batch.values, lengths=batch.lengths).values()).sum().backward()
    assert store_of(app).version("t0") == 0  # held
    ebc.flush()
    assert store_of(app).version("t0") == 1 and ebc.versions == {"t0": 1, "t1": 1, "t2": 1}
    mlp(ebc(keys=batch.keys, values=batch.values, lengths=batch.lengths).values()).sum().backward()
    client.delete_table("t2")  # the held push will be refused: 404, nothing applied
    with pytest.raises(RobezClientError) as caught:
        ebc.flush()
    assert caught.value.status == 404
    ebc.close()  # raised once, not again
    assert store_of(app).version("t0") == 1


def test_a_held_push_sent_first_does_not_take_the_pull_of_the_next_push(
    client_factory: Callable[..., TestClient],
) -> None:
    """Two forwards, then two backwards (gradient accumulation) with both options: the first push is
    held; a prefetch made before the second backward rides on the second push, so its rows include
    both pushes (the held one is sent alone, first)."""
    app = client_factory()
    client = served(app, OPTIMIZERS[0])
    seen: list[httpx.Request] = []
    batches = [make_batch(step) for step in range(3)]
    inputs = [{"keys": b.keys, "values": b.values, "lengths": b.lengths} for b in batches]
    with RemoteEmbeddingBagCollection(
        client, TABLES, prefetch_after_push=True, push_with_next_pull=True
    ) as ebc:
        first, second = ebc(**inputs[0]).values(), ebc(**inputs[1]).values()
        first.sum().backward()  # held
        ebc.prefetch(**inputs[2])  # waits for the next push
        app.event_hooks["request"].append(seen.append)
        second.sum().backward()  # the held push alone, then this push with the prefetch's pull
        with torch.no_grad():
            prefetched = ebc(**inputs[2]).values()
            fresh = ebc(**inputs[2]).values()
    assert torch.equal(prefetched, fresh)  # nothing stale
    assert [r.url.path for r in seen] == ["/v1/update", "/v1/update", "/v1/lookup"]
    assert "x-robez-lookup" in seen[1].headers and "x-robez-lookup" not in seen[0].headers
    assert store_of(app).version("t0") == 2


def test_a_failed_non_blocking_push_is_raised_by_the_next_call(
    client_factory: Callable[..., TestClient],
) -> None:
    app = client_factory()
    client = served(app, OPTIMIZERS[0])
    mlp = head()
    ebc = RemoteEmbeddingBagCollection(client, TABLES, max_pending_pushes=4)
    batch = make_batch(0)
    pooled = ebc(keys=batch.keys, values=batch.values, lengths=batch.lengths)
    client.delete_table("t2")  # the push of this step will be refused: 404
    mlp(pooled.values()).sum().backward()  # returns at once
    with pytest.raises(RobezClientError) as caught:
        ebc.flush()
    assert caught.value.status == 404
    ebc.flush()  # raised once, not again
    assert store_of(app).version("t0") == 0  # all-or-nothing: t0 and t1 untouched too
    ebc.close()


def test_bad_input_is_refused_before_anything_is_sent(client_factory: Callable[..., TestClient]) -> None:
    app = client_factory()
    client = served(app, OPTIMIZERS[0])
    seen: list[httpx.Request] = []
    app.event_hooks["request"].append(seen.append)
    batch = make_batch(0)
    with RemoteEmbeddingBagCollection(client, TABLES) as ebc:
        cases = [
            ({"keys": ["f0", "f1", "f2", "nope"]}, "unknown feature"),
            ({"keys": ["f0", "f1", "f2", "f2"]}, "every feature once"),
            ({"lengths": torch.cat([batch.lengths, torch.zeros(1, dtype=torch.int64)])}, "split into"),
            ({"lengths": batch.lengths + 1}, "values"),
            ({"values": batch.values.float()}, "int64"),
            ({"values": torch.where(batch.values == batch.values[0], 10**6, batch.values)}, "outside"),
        ]
        for change, message in cases:
            inputs = {"keys": batch.keys, "values": batch.values, "lengths": batch.lengths, **change}
            with pytest.raises(ValueError, match=message):
                ebc(**inputs)
    assert not seen


def test_a_nan_gradient_in_one_feature_applies_nothing(client_factory: Callable[..., TestClient]) -> None:
    app = client_factory()
    client = served(app, OPTIMIZERS[1])
    before = server_state(app)
    batch = make_batch(0)
    with RemoteEmbeddingBagCollection(client, TABLES) as ebc:
        pooled = ebc(keys=batch.keys, values=batch.values, lengths=batch.lengths).values()
        gradient = torch.ones_like(pooled)
        gradient[:, -1] = float("nan")  # f3's columns
        with pytest.raises(RobezClientError) as caught:
            pooled.backward(gradient)
    assert caught.value.status == 422 and "t2" in caught.value.error
    after = server_state(app)
    assert all(torch.equal(after[key], before[key]) for key in before)
    assert [store_of(app).version(name) for name in ("t0", "t1", "t2")] == [0, 0, 0]


def test_a_keyed_jagged_tensor_and_eval_without_grad(client_factory: Callable[..., TestClient]) -> None:
    app = client_factory()
    client = served(app, OPTIMIZERS[0])
    batch = make_batch(3)

    class KJT:  # torchrec's KeyedJaggedTensor, duck-typed as the local collection takes it
        def keys(self) -> list[str]:
            return batch.keys

        def values(self) -> Tensor:
            return batch.values

        def lengths(self) -> Tensor:
            return batch.lengths

        def offsets(self) -> None:
            return None

    local = local_twin(OPTIMIZERS[0])
    with RemoteEmbeddingBagCollection(client, TABLES) as ebc, torch.no_grad():
        out = ebc(KJT())
        assert out.keys() == ["f0", "f1", "f2", "f3"] and out["f3"].shape == (BATCH, 4)
        assert torch.equal(out.values(), local(KJT()).values())
        assert (
            ebc(keys=batch.keys, values=batch.values[:0], lengths=torch.zeros_like(batch.lengths))
            .values()
            .equal(torch.zeros(BATCH, 28))
        )
    assert store_of(app).version("t0") == 0
