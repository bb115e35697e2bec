"""``robez import --compress-to``: a trained full table becomes a served ROBE-Z table (least-squares fit)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from robez_core import RobezEmbedding
from service import cli
from service.wal import WalJournal


def _served(data_dir: Path, name: str):  # type: ignore[no-untyped-def]
    journal = WalJournal(data_dir)
    try:
        loaded = journal.load(name)
    finally:
        journal.close()
    assert loaded is not None
    return loaded


def test_an_nn_embedding_state_dict_is_compressed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    full = nn.Embedding(500, 16)
    checkpoint = tmp_path / "full.pt"
    torch.save(full.state_dict(), checkpoint)
    args = [
        "import",
        str(checkpoint),
        "--data-dir",
        str(tmp_path / "data"),
        "--table",
        "items",
        "--compress-to",
        "2000",
        "--chunk-size",
        "8",
        "--val-offset",
        "7",
        "--optimizer",
        "adagrad",
    ]
    assert cli.main(args) == 0
    assert "4.0x into 2000 floats" in capsys.readouterr().out
    table, version = _served(tmp_path / "data", "items")
    assert version == 0 and table.optimizer.name == "adagrad"
    config = table.config
    assert (config.num_embeddings, config.embedding_dim, config.memory_size) == (500, 16, 2000)
    assert (config.chunk_size, config.val_offset) == (8, 7)
    expected = RobezEmbedding.from_pretrained(full.weight.detach(), 2000, chunk_size=8, val_offset=7)
    ids = torch.arange(500)
    torch.testing.assert_close(table.lookup(ids), expected(ids))
    # iid values, 4 per slot on average: the mean keeps about 1/4 of the variance, zeros would keep none.
    error = float((table.lookup(ids) - full.weight.detach()).square().mean())
    assert error < 0.85 * float(full.weight.detach().square().mean())


def test_safetensors_and_the_key_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = tmp_path / "model.safetensors"
    users, items = torch.randn(50, 8), torch.randn(30, 8)
    save_file({"users.weight": users, "items.weight": items, "bias": torch.zeros(8)}, checkpoint)
    base = [
        "import",
        str(checkpoint),
        "--data-dir",
        str(tmp_path / "data"),
        "--table",
        "u",
        "--compress-to",
        "64",
    ]
    assert cli.main(base) == 2  # two tables in the file: which one?
    assert "name one with --key" in capsys.readouterr().err
    assert not (tmp_path / "data" / "u").exists()
    assert cli.main([*base, "--key", "users.weight"]) == 0
    table, _ = _served(tmp_path / "data", "u")
    expected = RobezEmbedding.from_pretrained(users, 64)
    torch.testing.assert_close(table.lookup(torch.arange(50)), expected(torch.arange(50)))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"not a checkpoint at all", "not a safetensors"),
        ({"weight": torch.randn(10)}, "2-D tensors"),
        ({"weight": torch.full((4, 4), float("nan"))}, "NaN"),
    ],
)
def test_bad_checkpoints_change_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: object, message: str
) -> None:
    checkpoint = tmp_path / "bad.pt"
    if isinstance(content, bytes):
        checkpoint.write_bytes(content)
    else:
        torch.save(content, checkpoint)
    args = [
        "import",
        str(checkpoint),
        "--data-dir",
        str(tmp_path / "data"),
        "--table",
        "t",
        "--compress-to",
        "64",
    ]
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "data" / "t").exists()
