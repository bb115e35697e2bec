"""Tables (markdown) and plots (PNG) of the quality experiments."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from .offline import METHODS, CompressionResult, Result
from .online import OnlineResult

__all__ = ["compression_table", "offline_table", "online_table", "plot_offline", "plot_online", "summarise"]

_LABELS = {
    "full": "full nn.Embedding",
    "robez-z32": "ROBE-Z, Z = 32",
    "robez-z8": "ROBE-Z, Z = 8",
    "hashing-z1": "hashing trick (Z = 1)",
}


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(results: Sequence[Result]) -> dict[tuple[str, int], dict[str, float]]:
    """(method, compression) -> mean and std of AUC and log-loss over seeds, and the floats."""
    groups: dict[tuple[str, int], list[Result]] = {}
    for row in results:
        groups.setdefault((row.method, row.compression), []).append(row)
    summary = {}
    for key, rows in groups.items():
        auc_mean, auc_std = _mean_std([row.auc for row in rows])
        loss_mean, loss_std = _mean_std([row.log_loss for row in rows])
        summary[key] = {
            "floats": float(rows[0].floats),
            "auc": auc_mean,
            "auc_std": auc_std,
            "log_loss": loss_mean,
            "log_loss_std": loss_std,
            "seeds": float(len(rows)),
            "untrained_auc": statistics.fmean(row.untrained_auc for row in rows),
            "seen_user_auc": statistics.fmean(row.seen_user_auc for row in rows),
            "new_user_auc": statistics.fmean(row.new_user_auc for row in rows),
        }
    return summary


def offline_table(results: Sequence[Result]) -> str:
    summary = summarise(results)
    lines = [
        "| method | compression | embedding floats | test AUC (mean ± std) | test log-loss (mean ± std) "
        "| AUC, returning users | AUC, new users | seeds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (method, compression), row in sorted(
        summary.items(), key=lambda item: (list(METHODS).index(item[0][0]), item[0][1])
    ):
        lines.append(
            f"| {_LABELS[method]} | {compression}x | {int(row['floats']):,} | {row['auc']:.4f} ± "
            f"{row['auc_std']:.4f} | {row['log_loss']:.4f} ± {row['log_loss_std']:.4f} "
            f"| {row['seen_user_auc']:.4f} | {row['new_user_auc']:.4f} | {int(row['seeds'])} |"
        )
    return "\n".join(lines)


def compression_table(rows: Sequence[CompressionResult]) -> str:
    lines = [
        "| compression (Z = 32) | full model AUC | after compressing | after 1 epoch of fine-tuning | "
        "log-loss after compressing -> fine-tuned | seeds |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for compression in sorted({row.compression for row in rows}):
        group = [row for row in rows if row.compression == compression]
        full, compressed, tuned = (
            _mean_std([getattr(row, name) for row in group])
            for name in ("full_auc", "compressed_auc", "finetuned_auc")
        )
        losses = (
            statistics.fmean(row.compressed_log_loss for row in group),
            statistics.fmean(row.finetuned_log_loss for row in group),
        )
        lines.append(
            f"| {compression}x | {full[0]:.4f} ± {full[1]:.4f} | {compressed[0]:.4f} ± {compressed[1]:.4f} | "
            f"{tuned[0]:.4f} ± {tuned[1]:.4f} | {losses[0]:.4f} -> {losses[1]:.4f} | {len(group)} |"
        )
    return "\n".join(lines)


def online_table(result: OnlineResult, chunk_size: int) -> str:
    names = list(result.auc)
    label = {
        name: "local full tables" if name == "full" else f"served ROBE-Z {name[6:]}, Z = {chunk_size}"
        for name in names
    }
    lines = [
        "| model | embedding floats | trailing-window AUC at the end | AUC of every prediction |",
        "|---|---:|---:|---:|",
    ]
    for name in names:
        lines.append(
            f"| {label[name]} | {result.floats[name]:,} | {result.auc[name][-1]:.4f} | "
            f"{result.progressive_auc[name]:.4f} |"
        )
    return "\n".join(lines) + (
        f"\n\nServed models together: {result.lookups:,} lookup requests at {result.lookups_per_s:,.0f}/s "
        "and "
        f"{result.pushes:,} gradient pushes at {result.pushes_per_s:,.0f}/s (client wall time of the forward "
        f"and backward passes); the replay of all models took {result.replay_seconds:.1f} s."
    )


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_offline(results: Sequence[Result], path: Path) -> None:
    plt = _pyplot()
    summary = summarise(results)
    figure, axis = plt.subplots(figsize=(7.5, 4.5))
    markers = {"robez-z32": "o", "robez-z8": "s", "hashing-z1": "^"}
    full = summary.get(("full", 1))
    for method, marker in markers.items():
        points = sorted(
            (row["floats"], row["auc"], row["auc_std"]) for (m, _), row in summary.items() if m == method
        )
        if points:
            xs, ys, errors = zip(*points, strict=True)
            axis.errorbar(xs, ys, yerr=errors, marker=marker, capsize=3, label=_LABELS[method])
    if full is not None:
        axis.axhline(full["auc"], color="black", linestyle="--", linewidth=1, label=_LABELS["full"])
        axis.axhspan(full["auc"] - 0.01, full["auc"], color="black", alpha=0.07, label="within 0.01 of full")
        axis.errorbar([full["floats"]], [full["auc"]], yerr=[full["auc_std"]], color="black", marker="D")
    axis.set_xscale("log")
    axis.set_xlabel("embedding floats (log scale; full tables at the right)")
    axis.set_ylabel("test AUC (mean ± std over seeds)")
    axis.set_title("MovieLens-100K, rating >= 4, train on the first 80% in time, test on the last 20%")
    axis.title.set_fontsize(9)
    axis.legend(fontsize=8)
    axis.grid(True, which="both", alpha=0.3)
    _save(figure, path)


def plot_online(result: OnlineResult, path: Path, window: int, chunk_size: int) -> None:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7.5, 4.2))
    for name, values in result.auc.items():
        if name == "full":
            axis.plot(
                result.seen, values, label="local full nn.Embedding tables", linestyle="--", color="black"
            )
        else:
            axis.plot(result.seen, values, label=f"served by robez: ROBE-Z {name[6:]}, Z = {chunk_size}")
    axis.set_xlabel("ratings replayed in timestamp order (predict, then train)")
    axis.set_ylabel(f"AUC of the last {window:,} predictions")
    axis.set_title("MovieLens-100K online: test-then-train through the live server")
    axis.title.set_fontsize(9)
    low = min(v for values in result.auc.values() for v in values if not math.isnan(v))
    axis.set_ylim(max(0.45, low - 0.02), None)
    axis.legend(fontsize=8)
    axis.grid(True, alpha=0.3)
    _save(figure, path)


def _save(figure, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    figure.clear()
