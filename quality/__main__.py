"""``python -m quality``: does ROBE-Z learn on real data? MovieLens-100K, offline and through the server.

    python -m quality                      # the full run: writes docs/quality/{latest.md,*.png,results.json}
    python -m quality --quick              # under a minute: fewer ratings, one seed, 16x only; no files
    python -m quality --only offline       # or: --only online (--url to use a running server)

Experiments (see quality/offline.py and quality/online.py): 1. quality vs memory offline (full tables,
ROBE-Z Z = 32 and Z = 8, hashing trick, at 1x..256x); 2. online test-then-train replay through a live
``robez serve``; 3. compressing the trained full model's tables with ``least_squares_array``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import resource
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from robez_core import hostinfo

from . import movielens
from .offline import CompressionResult, OfflineConfig, Result, as_dicts, run_offline
from .online import OnlineConfig, OnlineResult, run_online, serve
from .report import compression_table, offline_table, online_table, plot_offline, plot_online, summarise

QUICK_OFFLINE = OfflineConfig(
    seeds=(0,), compressions=(16,), finetune_compressions=(16,), epochs=1, train_limit=20_000
)
QUICK_ONLINE = OnlineConfig(compressions=(16,), limit=6_000, window=3_000)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the test-suite run (under a minute)")
    parser.add_argument("--only", choices=("offline", "online"), help="run one experiment only")
    parser.add_argument(
        "--out", type=Path, default=None, help="report folder (default docs/quality; none with --quick)"
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"where the recbole wheel is kept (default {movielens.default_cache_dir()})",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="read ml-100k.{inter,user,item} from here instead of the wheel (unchecked)",
    )
    parser.add_argument("--url", default=None, help="a running robez server (default: start one)")
    parser.add_argument("--threads", type=int, default=1, help="torch (and kernel) threads (default 1)")
    args = parser.parse_args(argv)
    if args.out is None and not args.quick:
        args.out = Path("docs/quality")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the experiments; returns everything measured (also written as results.json with --out)."""
    torch.set_num_threads(args.threads)
    started_wall, started_cpu = time.perf_counter(), time.process_time()
    data = movielens.load(args.cache_dir, args.data_dir)
    print(
        f"MovieLens-100K: {len(data)} ratings, "
        f"fields {dict(zip(data.fields, data.cardinalities, strict=True))}, "
        f"{data.num_genres} genres, {float(data.labels.mean()):.3f} positive",
        flush=True,
    )
    offline_config = QUICK_OFFLINE if args.quick else OfflineConfig()
    online_config = QUICK_ONLINE if args.quick else OnlineConfig()
    output: dict[str, Any] = {
        "offline_config": asdict(offline_config),
        "online_config": asdict(online_config),
    }

    def log(line: str) -> None:
        print(line, flush=True)

    if args.only in (None, "offline"):
        results, compressions = run_offline(data, offline_config, log)
        output["offline"] = as_dicts(results)
        output["compression"] = as_dicts(compressions)
    if args.only in (None, "online"):
        if args.url is None:
            with serve() as url:
                online = run_online(data, url, online_config, log)
        else:
            online = run_online(data, args.url, replace(online_config), log)
        output["online"] = {
            **asdict(online),
            "lookups_per_s": online.lookups_per_s,
            "pushes_per_s": online.pushes_per_s,
        }
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    output["run"] = {
        "command": shlex.join(["python", "-m", "quality", *(getattr(args, "argv", None) or sys.argv[1:])]),
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()} ({hostinfo.logical_cpus()} CPUs: {hostinfo.cpu_model()})",
        "torch_threads": args.threads,
        "wall_s": time.perf_counter() - started_wall,
        "cpu_s": time.process_time() - started_cpu,
        "server_cpu_s": children.ru_utime + children.ru_stime,
        "load_average": hostinfo.load_average(),
    }
    if args.out is not None:
        write_report(output, args.out)
    return output


def write_report(output: dict[str, Any], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(output, indent=1, default=float) + "\n")
    info = output["run"]
    sections = [
        "# Quality on MovieLens-100K (generated by `python -m quality`)",
        f"Command: `{info['command']}` — {info['date_utc']} on {info['machine']}, torch threads "
        f"{info['torch_threads']}; {info['wall_s']:.0f} s wall, {info['cpu_s']:.0f} s CPU in the experiment "
        f"process, {info['server_cpu_s']:.0f} s CPU in the server; load average at the end "
        f"{', '.join(f'{v:.1f}' for v in info['load_average'])} (other developers share the machine).",
    ]
    if "offline" in output:
        results = [Result(**row) for row in output["offline"]]
        plot_offline(results, folder / "offline.png")
        config = output["offline_config"]
        sections += [
            "## 1. Quality vs memory, offline",
            "Train on the earliest 80% of the ratings (by timestamp), test on the latest 20%; "
            f"d = {config['dim']}, "
            f"{config['epochs']} epochs of Adam (lr {config['lr']}, batch {config['batch_size']}) for every "
            f"method; seeds {config['seeds']}. Embedding floats: the shared ROBE-Z array, or all full "
            "tables.",
            offline_table(results),
            "![test AUC vs embedding floats](offline.png)",
        ]
    if "compression" in output:
        sections += [
            "## 3. Compressing the trained full model",
            "Each seed's full model above has all its tables compressed into one ROBE-Z array (Z = 32) with "
            "`robez_core.compress.least_squares_array` (what `RobezEmbedding.from_pretrained` does per "
            "table); "
            "the trained MLP is kept. Then one epoch of fine-tuning of the whole model.",
            compression_table([CompressionResult(**row) for row in output["compression"]]),
        ]
    if "online" in output:
        online_fields = {
            k: v for k, v in output["online"].items() if k not in ("lookups_per_s", "pushes_per_s")
        }
        online = OnlineResult(**online_fields)
        config = output["online_config"]
        plot_online(online, folder / "online.png", config["window"], config["chunk_size"])
        sections += [
            "## 2. Online, through the service",
            f"Ratings replayed in timestamp order, batches of {config['batch_size']}: predict (rows looked "
            "up over HTTP by `RemoteEmbedding`), record, then push the gradients (server-side "
            f"{config['optimizer']}, lr {config['server_lr']}); the local full model gets the same optimizer "
            "(torch's, sparse for adam) with the same lr and the same batches; every model's MLP starts "
            f"equal and is trained by a local Adam (lr {config['mlp_lr']}). Running AUC over the last "
            f"{config['window']:,} predictions. One server worker, one kernel thread, on the same machine "
            "as the client.",
            online_table(online, config["chunk_size"]),
            "![running AUC, served vs local](online.png)",
        ]
    (folder / "latest.md").write_text("\n\n".join(sections) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = argv
    output = run(args)
    if "offline" in output:
        summary = summarise([Result(**row) for row in output["offline"]])
        for (method, compression), row in sorted(summary.items()):
            print(f"{method:10s} {compression:4d}x AUC {row['auc']:.4f} ± {row['auc_std']:.4f}")
    print(f"done in {output['run']['wall_s']:.0f} s wall, {output['run']['cpu_s']:.0f} s CPU", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
