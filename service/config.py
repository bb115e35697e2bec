"""Server settings (the only place the environment is read) and the tables file.

Every knob has a default and can be set as ``ROBEZ_<NAME>`` (e.g. ``ROBEZ_PORT=9000``); ``robez serve``
options override the environment. Tables come from a TOML file (``--config tables.toml``), from the data
directory (``--data-dir``), or, when neither names any, from the built-in ``demo`` table.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from robez_core.config import OptimizerConfig, TableConfig
from robez_core.errors import ConfigError
from robez_core.hostinfo import usable_cpus

from .natsauth import NatsAuth

MiB = 1 << 20
GiB = 1 << 30

# The table served when nothing else is configured: d = 64, Z = 32, m = 262144 (1 MiB of float32).
DEMO_TABLE_NAME = "demo"
DEMO_TABLE_CONFIG = TableConfig(
    num_embeddings=10_000_000, embedding_dim=64, memory_size=262_144, chunk_size=32
)
DEMO_OPTIMIZER = OptimizerConfig(name="sgd", lr=0.01)


class Settings(BaseSettings):
    """Everything the server can be told, with defaults; env prefix ``ROBEZ_``."""

    model_config = SettingsConfigDict(
        env_prefix="ROBEZ_", extra="ignore", validate_default=True, populate_by_name=True
    )

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    # OpenTelemetry's own variables (no ROBEZ_ prefix), read here only to decide whether to trace; the SDK
    # reads the rest itself (service/tracing.py, docs/observability.md).
    otel_traces_exporter: str | None = Field(default=None, validation_alias="OTEL_TRACES_EXPORTER")
    otel_exporter_otlp_endpoint: str | None = Field(
        default=None,
        validation_alias=AliasChoices("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"),
    )
    otel_sdk_disabled: bool = Field(default=False, validation_alias="OTEL_SDK_DISABLED")
    trace_export_timeout_s: float = Field(
        default=2.0,
        gt=0,
        description="one export of spans to the OTLP collector, and the flush at a stop, wait at most "
        "this (over OTEL_EXPORTER_OTLP_TIMEOUT); spans that cannot be sent are dropped",
    )
    grpc_port: int | None = Field(
        default=None, ge=0, le=65535, description="gRPC inference protocol port (every worker); None: off"
    )
    workers: int = Field(default=1, ge=1, le=256, description="uvicorn worker processes")
    config: Path | None = Field(default=None, description="tables file (TOML); see docs/api.md")
    data_dir: Path | None = Field(default=None, description="durable tables (WAL + snapshots); None = memory")
    # Write-ahead log (service/wal/), used when data_dir is set; see docs/durability.md.
    wal_fsync: Literal["always", "interval", "never"] = Field(
        default="always",
        description="always: fdatasync before each update's response; interval: group commit, one "
        "fdatasync per wal_fsync_interval_ms shared by the updates waiting for it, each answered after "
        "its flush; never: leave it to the OS (all three survive kill -9, only always/interval power loss)",
    )
    wal_fsync_interval_ms: float = Field(default=10.0, gt=0)
    # Snapshots bound the log (disk) and the replay at start-up; 0 turns a trigger off.
    snapshot_every_updates: int = Field(default=10_000, ge=0, description="snapshot after this many updates")
    snapshot_every_seconds: float = Field(default=600.0, ge=0, description="... or when the last is this old")
    # ... or when the log outgrows a quarter of the table: over max(floor, ratio x the snapshot's bytes).
    # Bounds the log by bytes (records of big pushes are big), whatever the update count, and so the
    # replay at a restart: a snapshot no longer stalls pushes, so it can come often; docs/durability.md.
    snapshot_log_ratio: float = Field(
        default=0.25, ge=0, description="snapshot when the log exceeds this many times the snapshot's size"
    )
    snapshot_log_min_bytes: int = Field(
        default=64 * MiB, ge=0, description="... but not before the log holds this many bytes (the floor)"
    )
    snapshot_on_shutdown: bool = Field(default=True, description="snapshot updated tables on graceful stop")
    default_table: bool = Field(default=True, description="serve `demo` when no table is configured")
    log_level: str = "info"
    # One log line per request costs a measurable share of a small lookup; off unless asked for.
    access_log: bool = False
    # uvicorn kills a worker that does not answer its supervisor's ping within this; generous, since a
    # worker importing torch on a busy machine can take several seconds to answer its first ping.
    worker_healthcheck_timeout_s: int = Field(default=60, ge=1)

    # Kernel threads per worker; None = max(1, cpus // workers) so N workers never oversubscribe the CPUs.
    threads_per_worker: int | None = Field(default=None, ge=1)
    # Requests computing at once in one worker (each uses threads_per_worker kernel threads).
    compute_slots: int = Field(default=2, ge=1, le=64)
    # Fixed glibc malloc thresholds (robez_core.allocator.keep_freed_buffers): responses up to this size
    # reuse freed memory instead of page-faulting fresh mappings in on every large lookup; 0: glibc's own.
    malloc_mmap_threshold_mb: int = Field(
        default=32, ge=0, le=32, description="glibc M_MMAP_THRESHOLD per worker, MiB (0: glibc's default)"
    )
    # robez_core.buffers keeps large kernel outputs for reuse (a training process's 13 MB batches). A
    # worker's freed outputs are reused by the fixed malloc thresholds above already; a pool would only
    # keep up to this much more memory resident per worker. 0: off.
    output_pool_mb: int = Field(
        default=0, ge=0, le=4096, description="robez_core.buffers pool per worker, MiB (0: off)"
    )

    # HTTPS on the port (uvicorn's TLS); a client CA makes client certificates required. docs/security.md.
    tls_cert: Path | None = Field(default=None, description="server certificate (PEM); set: HTTPS")
    tls_key: Path | None = Field(default=None, description="the certificate's private key (PEM)")
    tls_client_ca: Path | None = Field(default=None, description="require client certificates from this CA")

    api_key: SecretStr | None = None
    read_api_key: SecretStr | None = None
    max_metric_tables: int = Field(
        default=64, ge=1, description="tables with their own metrics label per worker; the rest: _other"
    )
    # /metrics lists table names; /docs, /openapi.json and GET /v2 describe the server: open by default.
    private_endpoints: bool = Field(
        default=False,
        description="require the read key (or the write key) for /metrics, /docs, /openapi.json, GET /v2",
    )

    # Bodies are received whole before a request is admitted (service/http/middleware.py); binary is the bulk
    # format, JSON takes 5-37x its size while decoded into Python objects, hence its own, smaller bound.
    max_body_bytes: int = Field(default=64 * MiB, ge=1, description="any request body; larger: 413")
    max_json_body_bytes: int = Field(default=4 * MiB, ge=1, description="non-binary bodies; larger: 413")
    max_body_bytes_held: int = Field(
        default=1 * GiB,
        ge=1,
        description="request bodies one worker holds at once (arrived, until answered); over: 503",
    )
    body_timeout_s: float = Field(
        default=30.0, gt=0, description="a request's whole body must arrive within this; else 408, closed"
    )
    # Connections (service/http/protocol.py): uvicorn itself never closes one that sends no request.
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="a connection must send a request's headers within this of opening or of its last "
        "response; else it is closed",
    )
    keep_alive_timeout_s: int = Field(default=5, ge=1, description="idle keep-alive connections closed")
    # A stop (SIGTERM) must end within Kubernetes' 30 s grace whatever clients hold open: docs/api.md.
    shutdown_grace_s: float = Field(
        default=3.0,
        gt=0,
        description="on a stop, requests and gRPC calls under way get this long to finish (each port), "
        "then are cancelled and their connections closed",
    )
    max_connections: int = Field(
        default=1000, ge=1, description="open connections per worker; more are closed on accept"
    )
    direct_answers: bool = Field(
        default=True,
        description="small hot-route requests are answered by the connection itself, without an ASGI task "
        "and the middleware stack (same answers, metrics and limits; service/http/direct.py)",
    )
    max_ids_per_request: int = Field(default=1 << 18, ge=1)
    # Bounds the (n, d) rows a request may ask for or push, whatever d is.
    max_values_per_request: int = Field(default=1 << 25, ge=1)
    max_tables: int = Field(default=64, ge=1)
    max_embedding_dim: int = Field(default=4096, ge=1)
    max_memory_size: int = Field(default=1 << 28, ge=1, description="float32 values per table array")
    max_total_memory_bytes: int = Field(default=8 * GiB, ge=1, description="all arrays + optimizer state")
    max_in_flight: int = Field(default=64, ge=1, description="requests admitted per worker before 503")
    retry_after_s: int = Field(default=1, ge=0)

    # Replicated mode (service/replication/, docs/replication.md): a replica of tables kept identical
    # through a NATS JetStream log. None = the single-machine mode above.
    nats_url: str | None = Field(default=None, description="NATS server URL(s), comma-separated")
    nats_replicas: int = Field(default=3, ge=1, le=5, description="JetStream replication factor")
    # Who robez is to NATS and how it checks NATS (service/natsauth.py, docs/security.md).
    nats_user: str | None = Field(default=None, description="NATS user (with nats_password)")
    nats_password: SecretStr | None = Field(default=None, description="NATS user's password")
    nats_creds: Path | None = Field(default=None, description="NATS .creds file (JWT + nkey seed)")
    nats_nkey: Path | None = Field(default=None, description="NATS nkey seed file")
    nats_tls_ca: Path | None = Field(default=None, description="CA bundle of the NATS servers")
    nats_tls_cert: Path | None = Field(default=None, description="client certificate for NATS (mutual TLS)")
    nats_tls_key: Path | None = Field(default=None, description="... and its private key")
    replica_name: str | None = Field(default=None, description="this replica's name; default host:port")
    nats_prefix: str = Field(
        default="robez", pattern=r"^[A-Za-z0-9_-]{1,32}$", description="names of streams and buckets"
    )
    nats_dedup_window_s: float = Field(
        default=600.0, gt=0, description="Idempotency-Key retries within this window are applied once"
    )
    nats_publish_timeout_s: float = Field(default=10.0, gt=0, description="wait for a JetStream ack")
    # A hung NATS server keeps its socket open: it is noticed by unanswered pings (about their product).
    nats_ping_interval_s: float = Field(default=2.0, gt=0, description="ping the NATS server this often")
    nats_max_outstanding_pings: int = Field(
        default=2, ge=1, description="unanswered pings before the NATS server is taken for hung"
    )
    nats_write_check_interval_s: float = Field(
        default=1.0, gt=0, description="/readyz?writes=true: publish a tiny write-check message this often"
    )
    apply_wait_s: float = Field(default=10.0, gt=0, description="wait for an acked update to be applied")
    min_version_wait_ms: float = Field(
        default=1000.0, ge=0, description="X-Robez-Min-Version: wait this long for the version, then 503"
    )
    max_version_waiters: int = Field(
        default=32,
        ge=1,
        description="lookups per worker waiting for a version at once (they hold no max_in_flight slot); "
        "more: 503",
    )
    replica_snapshot_every_updates: int = Field(
        default=10_000, ge=0, description="upload a snapshot to the Object Store after this many updates"
    )
    replica_snapshot_interval_s: float = Field(
        default=300.0, ge=0, description="... or when the last upload is this old and updated since (0: off)"
    )
    replica_local_snapshot_every_updates: int = Field(
        default=1_000, ge=0, description="with --data-dir: write a local snapshot after this many updates"
    )
    replica_trim_keep: int = Field(
        default=1_000, ge=0, description="log entries kept below the newest snapshot when trimming"
    )

    shm_dir: Path = Field(default=Path("/dev/shm"), description="where shared table memory is created")
    # Set by `robez serve` for its workers: the prepared shared-memory directory to attach to.
    shm_path: Path | None = None

    @field_validator("log_level")
    @classmethod
    def _known_log_level(cls, value: str) -> str:
        value = value.lower()
        if value not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ValueError(f"unknown log level {value!r}")
        return value

    @field_validator("api_key", "read_api_key")
    @classmethod
    def _no_empty_key(cls, value: SecretStr | None) -> SecretStr | None:
        # An empty ROBEZ_API_KEY= must not silently mean "no auth" to someone who meant to set one.
        if value is not None and not value.get_secret_value():
            raise ValueError("an API key must not be empty; unset the variable to disable it")
        return value

    @model_validator(mode="after")
    def _tls_is_consistent(self) -> Settings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca needs tls_cert and tls_key (client certificates need HTTPS)")
        return self

    @model_validator(mode="after")
    def _nats_auth_is_consistent(self) -> Settings:
        self.nats_auth()  # raises ValueError on a half-given credential
        return self

    @model_validator(mode="after")
    def _one_body_fits_in_the_bodies_held(self) -> Settings:
        if self.max_body_bytes > self.max_body_bytes_held:
            raise ValueError(
                f"max_body_bytes ({self.max_body_bytes}) is over max_body_bytes_held "
                f"({self.max_body_bytes_held}): no body that large could ever be accepted"
            )
        return self

    def nats_auth(self) -> NatsAuth:
        """The NATS credentials and TLS material these settings name."""
        password = self.nats_password.get_secret_value() if self.nats_password is not None else None
        return NatsAuth(
            user=self.nats_user,
            password=password,
            creds=self.nats_creds,
            nkey=self.nats_nkey,
            tls_ca=self.nats_tls_ca,
            tls_cert=self.nats_tls_cert,
            tls_key=self.nats_tls_key,
        )

    def kernel_threads(self) -> int:
        """Kernel threads each worker uses: the setting, or the CPUs shared out over the workers."""
        if self.threads_per_worker is not None:
            return self.threads_per_worker
        return max(1, usable_cpus() // self.workers)


@dataclass(frozen=True)
class TableSpec:
    """One table as the tables file (or a create request) describes it."""

    config: TableConfig
    optimizer: OptimizerConfig
    share_array_with: str | None = None


def demo_table_spec() -> TableSpec:
    return TableSpec(DEMO_TABLE_CONFIG, DEMO_OPTIMIZER)


def table_spec_from_mapping(name: str, data: dict[str, Any]) -> TableSpec:
    """A ``TableSpec`` from one ``[tables.<name>]`` section; ConfigError names the table and the problem."""
    data = dict(data)
    optimizer_data = data.pop("optimizer", {})
    share = data.pop("share_array_with", None)
    if not isinstance(optimizer_data, dict):
        raise ConfigError(f"table {name!r}: 'optimizer' must be a table, e.g. [tables.{name}.optimizer]")
    if share is not None and not isinstance(share, str):
        raise ConfigError(f"table {name!r}: share_array_with must be a table name")
    try:
        return TableSpec(TableConfig.from_dict(data), OptimizerConfig.from_dict(optimizer_data), share)
    except TypeError as exc:  # unknown or missing keys
        raise ConfigError(f"table {name!r}: {exc}") from exc
    except ConfigError as exc:
        raise ConfigError(f"table {name!r}: {exc}") from exc


def load_tables_file(path: Path) -> dict[str, TableSpec]:
    """Parse a tables file: ``[tables.<name>]`` sections, in file order (shared arrays after their source)."""
    try:
        with path.open("rb") as file:
            document = tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"cannot read tables file {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"tables file {path} is not valid TOML: {exc}") from exc
    unknown = set(document) - {"tables"}
    if unknown:
        raise ConfigError(
            f"tables file {path}: unknown top-level keys {sorted(unknown)}; expected [tables.<name>]"
        )
    tables = document.get("tables", {})
    if not isinstance(tables, dict):
        raise ConfigError(f"tables file {path}: 'tables' must be a table of [tables.<name>] sections")
    specs: dict[str, TableSpec] = {}
    for name, section in tables.items():
        if not isinstance(section, dict):
            raise ConfigError(f"tables file {path}: [tables.{name}] must be a table")
        specs[name] = table_spec_from_mapping(name, section)
    return specs
