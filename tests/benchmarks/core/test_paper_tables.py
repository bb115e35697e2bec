"""The benchmark's code paths on toy sizes, so ``make bench`` cannot rot between full runs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from benchmarks.common import EMULATED_AVX2_CPU, avx2_emulation_env
from benchmarks.core import paper_tables

TOY_ARGS = [
    "--num-embeddings",
    "1000",
    "--embedding-dim",
    "16",
    "--chunk-size",
    "4",
    "--batch-size",
    "256",
    "--memory-sizes",
    "512",
]


def test_full_configuration_has_the_seed_rows():
    configs = paper_tables._configs(paper_tables.BenchSettings())
    assert len([c for c in configs if c.model == "full"]) == 6  # sparse x optimizer, one memory size
    assert len([c for c in configs if c.model == "reference"]) == 18  # x 3 memory sizes
    assert len([c for c in configs if c.model == "fused"]) == 18
    assert {c.memory_size for c in configs if c.model == "fused"} == set(paper_tables.PAPER_MEMORY_SIZES)


def test_quick_mode_keeps_the_target_rows():
    settings = paper_tables.settings_from_args(paper_tables.build_parser().parse_args(["--quick"]))
    labels = {c.label for c in paper_tables._configs(settings)}
    assert labels == {
        "full sparse adam",
        "reference dense adam m=262144",
        "fused dense adam m=262144",
        "fused sparse adam m=262144",
    }
    assert settings.threads == (1,)


def test_avx2_emulation_env_switches_off_every_avx512_feature():
    env = avx2_emulation_env()
    assert env["NUMBA_CPU_NAME"] == EMULATED_AVX2_CPU and env["ATEN_CPU_CAPABILITY"] == "avx2"
    features = env["NUMBA_CPU_FEATURES"].split(",")
    assert not [f for f in features if f.startswith("+avx512")]
    if "-avx2" not in features and any(f == "+avx2" for f in features):
        assert "+fma" in features  # an AVX2 host keeps what a Zen 2 has


def _share_timings(**fields: object) -> paper_tables.ShareTimings:
    """Shares of 40 ms (p10 30, p90 60) and 4 ms (p10 3.5, p90 5) over 56 steps, unless ``fields`` say
    otherwise."""
    defaults: dict[str, object] = {
        "reference": (40.0, 30.0, 60.0),
        "fused": (4.0, 3.5, 5.0),
        "adam_ms": 0.5,
        "reference_faults": 0.0,
        "fused_faults": 0.0,
        "steps": 56,
    }
    return paper_tables.ShareTimings(**{**defaults, **fields})  # type: ignore[arg-type]


def test_share_reading_prints_the_spread_and_ratios_from_its_data():
    text = _share_timings(reference_faults=1234.4).reading()
    assert "over 56 steps" in text and f"({paper_tables.SHARE_ROUNDS} alternating rounds)" in text
    assert "median 40.00 ms (p10 30.00, p90 60.00), 1234 minor page faults per step" in text
    assert "medians (10.0x)" in text and "is 7.5x faster" in text and "(p90) 15.0x" in text


def test_accesses_reading_bounds_what_faster_table_accesses_could_bring():
    def reading(trivial_ms: float) -> str:
        return _share_timings(trivial_accesses_ms=trivial_ms).accesses_reading(15.0)

    text = reading(3.2)
    assert "took 3.20 ms, against 4.00 ms with the hashed offsets" in text
    assert "cost 0.80 ms of the share" in text and "12.5x faster than the reference's median" in text
    assert "(9.4x against its fast steps, p10)" in text
    assert "no change to how the kernels reach the table could reach the 15x goal" in text
    assert "faster table accesses alone could reach the 15x goal" in reading(2.5)  # 16.0x


def test_fused_rows_step_fused_adam_and_the_others_torch_default_adam():
    params = [torch.nn.Parameter(torch.zeros(4))]

    def make(model: str, sparse: bool = False, **kwargs: bool) -> torch.optim.Optimizer:
        memory_size = None if model == "full" else 4
        config = paper_tables.RunConfig(model, sparse, "adam", memory_size)
        return paper_tables.make_optimizer(config, params, 0.1, **kwargs)

    def one_pass(optimizer: torch.optim.Optimizer) -> bool:
        return type(optimizer) is torch.optim.Adam and bool(optimizer.param_groups[0]["fused"])

    assert one_pass(make("fused"))
    assert type(make("fused", default_adam=True)) is torch.optim.Adam
    assert not one_pass(make("fused", default_adam=True))
    assert type(make("reference")) is torch.optim.Adam and not one_pass(make("reference"))
    assert type(make("full")) is torch.optim.Adam and not one_pass(make("full"))
    assert type(make("fused", sparse=True)) is torch.optim.SparseAdam

    def ops_of_a_step(optimizer: torch.optim.Optimizer) -> set[str]:
        params[0].grad = torch.ones(4)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            optimizer.step()
        return {event.key for event in profiler.key_averages()}

    # the fused rows really run torch's one-pass CPU kernel; the default Adam does not
    assert "aten::_fused_adam_" in ops_of_a_step(make("fused"))
    assert "aten::_fused_adam_" not in ops_of_a_step(make("reference"))


def test_optimizer_reading_puts_both_fused_shares_side_by_side_from_its_data():
    timings = _share_timings(
        adam_ms=0.2, fused_default_adam=(5.0, 4.5, 6.0), default_adam_ms=0.8, adam_paired_ratio=1.25
    )
    text = timings.optimizer_reading()
    assert "the fused share steps torch.optim.Adam(fused=True)" in text
    assert "with the default Adam took 5.00 ms (8.0x vs the reference)" in text
    assert "with Adam(fused=True) 4.00 ms (10.0x;" in text and "= 1.250)" in text
    assert "default Adam 0.80 ms, Adam(fused=True) 0.20 ms (4.0x)" in text
    assert "the other 3.80 ms" in text and "at most 200.0x faster" in text


@pytest.mark.slow
def test_quick_run_on_toy_sizes_writes_report_and_plot(tmp_path: Path):
    previous_threads = torch.get_num_threads()
    assert paper_tables.main(["--quick", "--profile", *TOY_ARGS, "--output-dir", str(tmp_path)]) == 0
    assert torch.get_num_threads() == previous_threads
    reports = list(tmp_path.glob("*-quick.md"))
    assert len(reports) == 1
    text = reports[0].read_text()
    assert "## Targets (1 thread)" in text
    assert "| ROBE-Z fused | False | 256 | 512 (0.0 MB) | adam |" in text
    assert "| full nn.Embedding | True | 256 | 16000 (0.1 MB) | adam |" in text
    assert "python -m benchmarks.core.paper_tables --quick" in text
    for line in (
        "| cpu vector extensions |",
        "| fused kernels compiled for |",
        "| torch kernels dispatched for |",
    ):
        assert line in text
    assert "embedding's share of that step" in text and "model's own work in a step" in text
    assert "the fused share steps torch.optim.Adam(fused=True)" in text
    assert "with the default Adam took" in text
    assert "Table accesses: in the same alternating rounds" in text
    assert "fused + Adam(fused=True) vs reference + default Adam" in text
    assert "Embedding share over" in text and "minor page faults per step" in text
    assert "Where the fused share's" in text and "scatter x2" in text and "gather x2" in text
    assert "Memory floor of the share" in text and "Best ratio any kernel could reach" in text
    assert "| malloc | glibc defaults |" in text
    assert list(tmp_path.glob("*-quick.png"))
    profile = next(tmp_path.glob("*-quick-profile.md")).read_text()
    assert "| loss.backward() |" in profile and "_FusedLookup" in profile
    assert "`torch.optim.Adam(fused=True)` for the fused model" in profile
    assert "-quick-profile.md" in text
    assert not (tmp_path / "latest.md").exists()  # quick runs never replace the committed full report


@pytest.mark.slow
def test_run_benchmark_measures_every_phase_and_marks_skipped_rows(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(paper_tables, "SLOW_MEMORY_SIZE", 1024)
    settings = paper_tables.BenchSettings(
        num_embeddings=500,
        embedding_dim=10,
        chunk_size=4,
        batch_size=64,
        memory_sizes=(256, 2048),
        optimizers=("sgd", "adam"),
        threads=(1,),
        iterations=3,
        target_repeats=3,
        skip_slow=True,
    )
    messages: list[str] = []
    result = paper_tables.run_benchmark(settings, "test", log=messages.append)
    assert len([m for m in messages if m.startswith("[")]) == len(result.runs)  # a progress line per row
    # toy sizes miss the targets, and a full (non-quick) run then profiles the fused step by itself
    assert any(not t.met for t in result.targets) == (result.profile is not None)
    skipped = [run for run in result.runs if run.skipped]
    assert {run.config.label for run in skipped} == {
        "reference dense sgd m=2048",
        "reference dense adam m=2048",
    }
    for run in result.runs:
        if run.skipped:
            continue
        assert run.total_ms == pytest.approx(run.forward_ms + run.gradcomp_ms + run.backward_ms)
        assert all(v > 0 for v in (run.forward_ms, run.gradcomp_ms, run.backward_ms))
        assert math.isnan(run.hashing_ms) == (run.config.model == "full")
    assert len(result.targets) == 6
    assert all(t.baseline_ms > 0 and t.fused_ms > 0 for t in result.targets)
    markdown = paper_tables.render_markdown(result)
    assert "skipped (--skip-slow)" in markdown
    assert "left out" in markdown


def test_read_seed_totals_takes_the_one_cpu_table(tmp_path: Path):
    notes = tmp_path / "004.txt"
    row = (
        "| {i} | {model} | {sparse} | 32768 | {params} | 1.0 | nan | nan | nan | 2.0 | 3.0 | {total} "
        "| 1.0MB | adam |"
    )
    notes.write_text(
        "\n".join(
            [
                "1CPU:",
                "| | Model | sparse | bs | mem_params | forward | hashing | lookup | other | gradcomp "
                "| backward | total | msize | optim |",
                row.format(i=0, model="FullEmbedding", sparse="True", params=100000000, total=160.5),
                row.format(i=1, model="RobezEmbedding", sparse="False", params=262144, total=156.53),
                "10CPU",
                row.format(i=0, model="RobezEmbedding", sparse="False", params=262144, total=28.6),
            ]
        )
    )
    totals = paper_tables.read_seed_totals(notes)
    assert totals == {("full", True, 100000000, "adam"): 160.5, ("robez", False, 262144, "adam"): 156.53}
    assert paper_tables.read_seed_totals(notes, cpus=10) == {("robez", False, 262144, "adam"): 28.6}
    assert paper_tables.read_seed_totals(tmp_path / "missing.txt") == {}
