"""``RemoteEmbeddingBag`` as a drop-in ``nn.EmbeddingBag`` (issue 37): default mode, include_last_offset,
B+1 offsets, max pooling, sparse; output and the pushed step compared with torch's own module."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from service.client import RemoteEmbeddingBag

from .test_client import FakeServer


def torch_twin(server: FakeServer, **kwargs: object) -> nn.EmbeddingBag:
    """``nn.EmbeddingBag`` holding the fake server's rows (dense weight, to compare gradients)."""
    return nn.EmbeddingBag.from_pretrained(server.rows.clone(), freeze=False, **kwargs)  # type: ignore[arg-type]


def test_default_mode_is_mean_like_torch() -> None:
    server = FakeServer()
    bag = RemoteEmbeddingBag(server.client(), "t", embedding_dim=4)
    assert bag.mode == nn.EmbeddingBag(10, 4).mode == "mean"
    ids = torch.tensor([[1, 2, 3], [4, 4, 5]])
    assert torch.allclose(bag(ids), torch_twin(server)(ids), atol=1e-6)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize(
    ("offsets", "include_last_offset"),
    [
        ([0, 3, 3, 5], False),  # B bag starts, one empty bag
        ([0, 3, 3, 5, 7], True),  # B+1 (torchrec/FBGEMM): the last entry ends the last bag
        ([0, 3, 3, 5, 7], False),  # B+1 without the flag: torch reads B+1 bags, the last one empty
        ([0, 0, 7, 7], True),  # empty first and last bags
    ],
)
def test_bags_and_their_step_match_nn_embedding_bag(
    mode: str, offsets: list[int], include_last_offset: bool
) -> None:
    server = FakeServer(lr=1.0)
    bag = RemoteEmbeddingBag(
        server.client(), "t", mode=mode, include_last_offset=include_last_offset, sparse=True, embedding_dim=4
    )
    reference = torch_twin(server, mode=mode, include_last_offset=include_last_offset)
    ids, offsets_tensor = torch.tensor([4, 5, 4, 8, 1, 2, 2]), torch.tensor(offsets)
    out = bag(ids, offsets_tensor)
    expected = reference(ids, offsets_tensor)
    assert out.shape == expected.shape
    assert torch.allclose(out, expected, atol=1e-6)
    gradient = torch.randn_like(expected)
    (out * gradient).sum().backward()
    (expected * gradient).sum().backward()
    assert reference.weight.grad is not None
    # The server stepped exactly the rows torch's gradient touches (sgd, lr 1 on the fake server).
    assert torch.allclose(server.rows, reference.weight.detach() - reference.weight.grad, atol=1e-5)


def test_per_sample_weights_with_sum_and_refused_otherwise() -> None:
    server = FakeServer()
    bag = RemoteEmbeddingBag(server.client(), "t", mode="sum", include_last_offset=True, embedding_dim=4)
    ids, offsets, weights = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3]), torch.rand(3)
    reference = torch_twin(server, mode="sum", include_last_offset=True)
    assert torch.allclose(bag(ids, offsets, weights), reference(ids, offsets, weights), atol=1e-6)
    with pytest.raises(ValueError, match="mode='sum'"):
        RemoteEmbeddingBag(server.client(), "t", mode="max", embedding_dim=4)(ids, offsets, weights)


def test_bad_configs_and_offsets_are_clear_errors() -> None:
    server = FakeServer()
    with pytest.raises(ValueError, match="mode must be one of"):
        RemoteEmbeddingBag(server.client(), "t", mode="median", embedding_dim=4)
    bag = RemoteEmbeddingBag(server.client(), "t", include_last_offset=True, embedding_dim=4)
    with pytest.raises(ValueError, match="at least one offset"):
        bag(torch.tensor([1]), torch.tensor([], dtype=torch.int64))
    with pytest.raises(ValueError, match="past"):
        bag(torch.tensor([1]), torch.tensor([0, 2]))


def test_no_ids_gives_zero_bags() -> None:
    server = FakeServer()
    bag = RemoteEmbeddingBag(server.client(), "t", embedding_dim=4)
    out = bag(torch.zeros(0, dtype=torch.int64), torch.tensor([0, 0]))
    assert torch.equal(out, torch.zeros(2, 4))
    assert not server.requests  # nothing to fetch
