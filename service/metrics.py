"""Prometheus metrics (prefix ``robez_``) and the ``Server-Timing`` header.

With several workers, metrics use prometheus_client's multiprocess mode: each worker writes its samples
to files in ``<shared dir>/metrics`` (``PROMETHEUS_MULTIPROC_DIR``, set by ``robez serve`` before the
workers start) and ``/metrics`` through any worker sums them all.

Table labels are bounded: a worker gives at most ``max_tables`` tables their own ``table`` label, the rest
share ``_other``. The series of tables that no longer exist are removed, freeing their places, when a
worker is scraped and when it labels a new table at the cap (``live_tables``); in multiprocess mode they
are removed from the worker's files too (``metricfiles.FileValues``), so create/drop churn leaves the
files as they were: a worker's hold at most ``max_tables`` tables' series, a scraped worker's only live ones.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.types import Scope

from .metricfiles import FileValues

# The label of tables past the cap on table labels (a table name never starts with "_").
OTHER_TABLES = "_other"

# Stage times run from a few microseconds (small hash) to seconds (a huge JSON request).
_STAGE_BUCKETS = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    1.0,
)
_REQUEST_BUCKETS = (
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)


@dataclass(frozen=True)
class TableStages:
    """One table's children of the stage histograms (``Metrics.stages``)."""

    hash_seconds: Any
    lookup_seconds: Any
    update_apply_seconds: Any


class Metrics:
    """The server's metrics, registered in a registry of their own (one per app).

    Args:
        multiprocess_dir: the directory workers write samples to, or None in a single process (one
            multiprocess ``Metrics`` per process: its value class is prometheus_client's global).
        max_tables: tables that get their own ``table`` label (module docstring); others: ``_other``.
    """

    def __init__(self, multiprocess_dir: Path | None = None, max_tables: int = 64) -> None:
        self.multiprocess_dir = multiprocess_dir
        self.max_tables = max_tables
        self._named_tables: set[str] = set()
        # The tables that exist (set by the app once its store is open): read when the label cap is reached.
        self.live_tables: Callable[[], Collection[str]] | None = None
        self.files: FileValues | None = None
        if multiprocess_dir is not None:
            self.files = FileValues(multiprocess_dir)
            self.files.install()  # before the first series below is created
        self.registry = CollectorRegistry()
        self.hash_seconds = Histogram(
            "robez_hash_seconds",
            "Time hashing ids to chunk offsets",
            ["table"],
            registry=self.registry,
            buckets=_STAGE_BUCKETS,
        )
        self.lookup_seconds = Histogram(
            "robez_lookup_seconds",
            "Time gathering (and pooling) rows",
            ["table"],
            registry=self.registry,
            buckets=_STAGE_BUCKETS,
        )
        self.update_apply_seconds = Histogram(
            "robez_update_apply_seconds",
            "Time applying an optimizer step under the table lock",
            ["table"],
            registry=self.registry,
            buckets=_STAGE_BUCKETS,
        )
        self.request_duration_seconds = Histogram(
            "robez_request_duration_seconds",
            "Request time in the app",
            ["endpoint", "method", "table", "status"],
            registry=self.registry,
            buckets=_REQUEST_BUCKETS,
        )
        self.requests_total = Counter(
            "robez_requests",
            "Requests answered",
            ["endpoint", "method", "table", "status"],
            registry=self.registry,
        )
        self.storage_full_total = Counter(
            "robez_storage_full",
            "Writes (updates, snapshots, new or loaded tables) refused with 507: the data directory is full",
            registry=self.registry,
        )
        self._stages: dict[str, TableStages] = {}
        # labels -> (histogram child, counter child) of the request metrics (``observe_request``)
        self._request_children: dict[tuple[str, str, str, str], tuple[Any, Any]] = {}
        self.rejected_total = Counter(
            "robez_rejected", "Requests refused before reaching a route", ["reason"], registry=self.registry
        )
        self.client_disconnects_total = Counter(
            "robez_client_disconnects",
            "Requests whose client went away before their body arrived",
            registry=self.registry,
        )
        self.connections_closed_total = Counter(
            "robez_connections_closed",
            "Connections closed by the server: header_timeout (no request's headers in time), "
            "max_connections (over the cap on accept)",
            ["reason"],
            registry=self.registry,
        )

        # Replicated mode (service/replication/): set by the worker that applies the log.
        self.replication_lag_versions = Gauge(
            "robez_replication_lag_versions",
            "The log's last position minus the version this replica applied",
            ["table"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.replication_lag_seconds = Gauge(
            "robez_replication_lag_seconds",
            "Age (upper bound) of the oldest log entry this replica has not applied; 0 when caught up",
            ["table"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.replication_last_apply_timestamp = Gauge(
            "robez_replication_last_apply_timestamp_seconds",
            "Unix time this replica last applied a log entry",
            ["table"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.replication_skipped_total = Counter(
            "robez_replication_skipped",
            "Log entries this replica applied as empty versions (the version advanced, the table did not "
            "change) because they failed a check, by reason: bad_headers, bad_payload, bad_lr, bad_ids, "
            "bad_grads, non_finite_step, load_missing, load_corrupt",
            ["table", "reason"],
            registry=self.registry,
        )
        self.replication_publish_ack_seconds = Histogram(
            "robez_replication_publish_ack_seconds",
            "Time from publishing an update to the log's acknowledgement (quorum stored it)",
            ["table"],
            registry=self.registry,
            buckets=_REQUEST_BUCKETS,
        )
        self.replication_apply_delay_seconds = Histogram(
            "robez_replication_apply_delay_seconds",
            "Time from the log storing an update to this replica having applied it",
            ["table"],
            registry=self.registry,
            buckets=_REQUEST_BUCKETS,
        )
        self._table_metrics = [
            (metric, list(metric._labelnames).index("table"))
            for metric in (
                self.hash_seconds,
                self.lookup_seconds,
                self.update_apply_seconds,
                self.request_duration_seconds,
                self.requests_total,
                self.replication_lag_versions,
                self.replication_lag_seconds,
                self.replication_last_apply_timestamp,
                self.replication_publish_ack_seconds,
                self.replication_apply_delay_seconds,
            )
        ]
        for metric, index in self._table_metrics:
            metric.labels = _table_capped(metric.labels, index, self.table)  # type: ignore[method-assign]

    def table(self, name: str) -> str:
        """The ``table`` label of table ``name``: its name while fewer than ``max_tables`` tables have
        their own, else ``_other``."""
        if not name or name in self._named_tables:
            return name
        if len(self._named_tables) >= self.max_tables and self.live_tables is not None:
            self.forget_tables(set(self.live_tables()))  # the places of dropped tables are given again
        if len(self._named_tables) >= self.max_tables:
            return OTHER_TABLES
        self._named_tables.add(name)
        return name

    def forget_tables(self, live: set[str]) -> None:
        """Remove the series of labelled tables not in ``live`` (from this worker's files too, in
        multiprocess mode) and the children kept for them."""
        gone = self._named_tables - live
        with warnings.catch_warnings():  # "not implemented in multi-process mode": FileValues does it
            warnings.simplefilter("ignore", UserWarning)
            for name in gone:
                self._named_tables.discard(name)
                for metric, _ in self._table_metrics:
                    metric.remove_by_labels({"table": name})
        if gone and self.files is not None:
            self.files.forget(gone)
        for name in [name for name in self._stages if name not in live]:
            del self._stages[name]
        for labels in [labels for labels in self._request_children if labels[2] not in live]:
            del self._request_children[labels]

    def stages(self, table: str) -> TableStages:
        """The stage histograms of one table, labelled once (``labels()`` costs a lock and checks)."""
        stages = self._stages.get(table)
        if stages is None:
            stages = self._stages[table] = TableStages(
                self.hash_seconds.labels(table),
                self.lookup_seconds.labels(table),
                self.update_apply_seconds.labels(table),
            )
        return stages

    def observe_request(self, endpoint: str, method: str, table: str, status: int, seconds: float) -> None:
        """Count and time one answered request (``labels()`` costs a lock and checks: children are kept)."""
        labels = (endpoint, method, table, str(status))
        children = self._request_children.get(labels)
        if children is None:
            children = self._request_children[labels] = (
                self.request_duration_seconds.labels(*labels),
                self.requests_total.labels(*labels),
            )
        children[0].observe(seconds)
        children[1].inc()

    def samples(self) -> Iterator[tuple[str, dict[str, str], float]]:
        """Every sample (name, labels, value) of this registry, summed over every worker in multiprocess
        mode: what ``/v2/models/stats`` reads (service/oip.py ``model_statistics``)."""
        if self.multiprocess_dir is None:
            return _samples(self.registry.collect())
        return _samples(MultiProcessCollector(None, path=str(self.multiprocess_dir)).collect())

    def render(self, live_tables: Iterable[str] | None = None) -> tuple[bytes, str]:
        """Prometheus text exposition of every worker's samples, and its content type; with
        ``live_tables``, series of other tables are forgotten (``forget_tables``) and left out."""
        live = set(live_tables) if live_tables is not None else None
        if live is not None:
            self.forget_tables(live)
        if self.multiprocess_dir is None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        registry = CollectorRegistry(auto_describe=False)
        files = MultiProcessCollector(None, path=str(self.multiprocess_dir))
        registry.register(_LiveTables(files, live) if live is not None else files)
        return generate_latest(registry), CONTENT_TYPE_LATEST


def _samples(metrics: Iterable[Metric]) -> Iterator[tuple[str, dict[str, str], float]]:
    for metric in metrics:
        for sample in metric.samples:
            yield sample.name, sample.labels, sample.value


def _table_capped(labels: Callable[..., Any], index: int, table: Callable[[str], str]) -> Callable[..., Any]:
    """A metric's ``labels`` whose ``table`` value (at ``index``) goes through ``table`` (the cap)."""

    def capped(*values: str) -> Any:
        return labels(*values[:index], table(values[index]), *values[index + 1 :])

    return capped


class _LiveTables(Collector):
    """The samples of another collector, less those labelled with a table that no longer exists."""

    def __init__(self, source: MultiProcessCollector, live: set[str]) -> None:
        self.source = source
        self.keep = live | {"", OTHER_TABLES}

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            family.samples = [s for s in family.samples if s.labels.get("table", "") in self.keep]
            yield family


def server_timing(**stages_seconds: float) -> str:
    """``Server-Timing`` value, e.g. ``hash;dur=0.012, lookup;dur=0.030, total;dur=0.101`` (milliseconds)."""
    return ", ".join(f"{name};dur={seconds * 1000.0:.4f}" for name, seconds in stages_seconds.items())


_LOOKUP_TIMING = b"hash;dur=%.4f, lookup;dur=%.4f, total;dur=%.4f"
_UPDATE_TIMING = b"hash;dur=%.4f, apply;dur=%.4f, total;dur=%.4f"


def lookup_server_timing(hash_s: float, lookup_s: float, total_s: float) -> bytes:
    """``server_timing(hash=..., lookup=..., total=...)`` as header bytes, formatted in one step."""
    return _LOOKUP_TIMING % (hash_s * 1000.0, lookup_s * 1000.0, total_s * 1000.0)


def update_server_timing(hash_s: float, apply_s: float, total_s: float) -> bytes:
    """``server_timing(hash=..., apply=..., total=...)`` as header bytes, formatted in one step."""
    return _UPDATE_TIMING % (hash_s * 1000.0, apply_s * 1000.0, total_s * 1000.0)


def set_table_label(request: Request, table: str) -> None:
    """Label this request's metrics with ``table`` (``request.state.table``, without building the State)."""
    state = request.scope.get("state")
    if state is None:
        state = request.scope["state"] = {}
    state["table"] = table


def table_label(scope: Scope) -> str:
    """The table label ``set_table_label`` gave this request ("" if none)."""
    return str(scope.get("state", {}).get("table", ""))
