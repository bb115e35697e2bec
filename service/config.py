"""Server settings (every ``ROBEZ_*`` setting is read here; ``service/app.py`` and ``service/cli.py`` also
read the two internal variables that are no settings, the workers' shared directory and the test hooks
of ``service/faults.py``) and the tables file.

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


# Sections of the settings, in the order docs/configuration.md lists them: (key, title, what they are for).
# Every field below names its section in ``json_schema_extra={"group": ...}``; the fields of a section
# stand together in the class, in the same order as in the docs (tests/service/test_config_docs.py).
GROUPS: tuple[tuple[str, str, str], ...] = (
    ("listen", "Listening, TLS and authentication", "Where the server listens and who may call it."),
    ("processes", "Workers and threads", "How many processes and kernel threads serve the tables."),
    ("tables", "Tables and the data directory", "Which tables are served and where they are kept."),
    (
        "durability",
        "Durability (with a data directory)",
        "The write-ahead log's fsync policy and when snapshots are taken ([durability.md](durability.md)).",
    ),
    (
        "limits",
        "Limits",
        "Bounds on requests, connections and tables; what is over a bound is refused (413, 422, 503, 408) "
        "and changes nothing.",
    ),
    (
        "replication",
        "Replication (NATS JetStream)",
        "Replicated mode, set by a NATS URL ([replication.md](replication.md), NATS logins and TLS: "
        "[security.md](security.md#nats-logins-permissions-and-tls)).",
    ),
    (
        "telemetry",
        "Logs, metrics and traces",
        "Traces are configured with OpenTelemetry's own variables ([observability.md](observability.md)); "
        "the three read here decide whether to trace at all.",
    ),
    (
        "advanced",
        "Advanced tuning",
        "Defaults measured on the benchmarks; each exists for the reason given, and none needs changing "
        "in a normal deployment.",
    ),
)

_LISTEN: dict[str, Any] = {"group": "listen"}
_PROCESSES: dict[str, Any] = {"group": "processes"}
_TABLES: dict[str, Any] = {"group": "tables"}
_DURABILITY: dict[str, Any] = {"group": "durability"}
_LIMITS: dict[str, Any] = {"group": "limits"}
_REPLICATION: dict[str, Any] = {"group": "replication"}
_TELEMETRY: dict[str, Any] = {"group": "telemetry"}
_ADVANCED: dict[str, Any] = {"group": "advanced"}


class Settings(BaseSettings):
    """Everything the server can be told, with defaults; env prefix ``ROBEZ_``. The reference, by section:
    docs/configuration.md (generated from this class: ``python -m devtools.settings_reference``)."""

    model_config = SettingsConfigDict(
        env_prefix="ROBEZ_", extra="ignore", validate_default=True, populate_by_name=True
    )

    # -- listen: the HTTP (and gRPC) ports, HTTPS, keys. docs/security.md.
    host: str = Field(default="127.0.0.1", json_schema_extra=_LISTEN, description="bind address")
    port: int = Field(default=8000, ge=0, le=65535, json_schema_extra=_LISTEN, description="HTTP port")
    grpc_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        json_schema_extra=_LISTEN,
        description="also serve the inference protocol over gRPC on this port, from every worker "
        "([api.md](api.md#the-same-protocol-over-grpc---grpc-port)); none: off",
    )
    grpc_engine: Literal["grpcio", "frames"] = Field(
        default="frames",
        json_schema_extra=_LISTEN,
        description="what serves the gRPC port: frames (robez's own HTTP/2 frames, service/grpc/frames.py: "
        "docs/benchmarks/grpc-frames-engine-2026-11-28.md), or grpcio (grpc.aio)",
    )
    grpc_idle_timeout_s: float = Field(
        default=300.0,
        gt=0,
        json_schema_extra=_LISTEN,
        description="frames engine: a gRPC connection with no call open for this long, or holding answers "
        "for a peer that sent nothing for this long, is sent GOAWAY and closed (clients reconnect); its "
        "HTTP/2 preface must come within header_timeout_s",
    )
    grpc_max_unread_answer_bytes: int = Field(
        default=256 * MiB,
        ge=1,
        json_schema_extra=_LISTEN,
        description="frames engine: answers one gRPC connection's peer has not taken yet (held back by its "
        "windows, or unread); one more past this is refused, RESOURCE_EXHAUSTED naming it (all of them "
        "count against max_body_bytes_held too)",
    )
    grpc_keepalive_time_s: float = Field(
        default=7200.0,
        gt=0,
        json_schema_extra=_LISTEN,
        description="gRPC keepalive (both engines; grpcio's defaults, docs/api.md): a connection with a call "
        "open (any, with grpc_keepalive_permit_without_calls) from which nothing came for this long is "
        "sent a PING",
    )
    grpc_keepalive_timeout_s: float = Field(
        default=20.0,
        gt=0,
        json_schema_extra=_LISTEN,
        description="no answer to the keepalive PING within this: the connection is closed (a dead peer)",
    )
    grpc_keepalive_permit_without_calls: bool = Field(
        default=False,
        json_schema_extra=_LISTEN,
        description="keepalive PINGs on connections without calls too, both ways: ours are sent, and a "
        "client's are held to grpc_min_ping_interval_s (off: to one per two hours)",
    )
    grpc_min_ping_interval_s: float = Field(
        default=300.0,
        ge=0,
        json_schema_extra=_LISTEN,
        description="a client's PING sooner than this after its last, with no data of ours between, is a "
        "strike (grpc's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS)",
    )
    grpc_max_ping_strikes: int = Field(
        default=2,
        ge=0,
        json_schema_extra=_LISTEN,
        description="past this many strikes the connection is sent GOAWAY ENHANCE_YOUR_CALM "
        '"too_many_pings" and closed; 0: no limit',
    )
    # HTTPS on the port (uvicorn's TLS); a client CA makes client certificates required.
    tls_cert: Path | None = Field(
        default=None, json_schema_extra=_LISTEN, description="server certificate (PEM); set: HTTPS"
    )
    tls_key: Path | None = Field(
        default=None, json_schema_extra=_LISTEN, description="the certificate's private key (PEM)"
    )
    tls_client_ca: Path | None = Field(
        default=None,
        json_schema_extra=_LISTEN,
        description="require client certificates signed by this CA (HTTPS only)",
    )
    api_key: SecretStr | None = Field(
        default=None,
        json_schema_extra=_LISTEN,
        description="bearer key for writes (create, delete, update, snapshot, load, checkpoint); none: open",
    )
    read_api_key: SecretStr | None = Field(
        default=None,
        json_schema_extra=_LISTEN,
        description="bearer key for reads (lookups, table listing); the write key also reads",
    )
    # /metrics lists table names; /docs, /openapi.json and GET /v2 describe the server: open by default.
    private_endpoints: bool = Field(
        default=False,
        json_schema_extra=_LISTEN,
        description="require the read key (or the write key) for /metrics, /docs, /openapi.json and GET /v2 "
        "too (/redoc is then off)",
    )

    # -- processes
    workers: int = Field(
        default=1,
        ge=1,
        le=256,
        json_schema_extra=_PROCESSES,
        description="worker processes (uvicorn servers), sharing one copy of every table",
    )
    # None = max(1, cpus // workers) so N workers never oversubscribe the CPUs.
    threads_per_worker: int | None = Field(
        default=None,
        ge=1,
        json_schema_extra=_PROCESSES,
        description="kernel threads per worker; none: the usable CPUs // workers (at least 1)",
    )

    # -- tables
    config: Path | None = Field(
        default=None, json_schema_extra=_TABLES, description="tables file (TOML; [api.md](api.md))"
    )
    data_dir: Path | None = Field(
        default=None,
        json_schema_extra=_TABLES,
        description="snapshots + write-ahead log (a replica's: its local snapshots); none: tables in memory "
        "only ([durability.md](durability.md))",
    )
    default_table: bool = Field(
        default=True,
        json_schema_extra=_TABLES,
        description="serve the built-in `demo` table when neither the tables file nor the data directory "
        "names a table",
    )
    shm_dir: Path = Field(
        default=Path("/dev/shm"),
        json_schema_extra=_TABLES,
        description="where the workers' shared table memory is created (a tmpfs)",
    )

    # -- durability: the write-ahead log (service/wal/), used when data_dir is set.
    wal_fsync: Literal["always", "interval", "never"] = Field(
        default="always",
        json_schema_extra=_DURABILITY,
        description="always: fdatasync before each update's response; interval: group commit, one "
        "fdatasync per `wal_fsync_interval_ms` shared by the updates waiting for it, each answered after "
        "its flush; never: leave it to the OS (all three survive kill -9, only always/interval power loss)",
    )
    wal_fsync_interval_ms: float = Field(
        default=10.0, gt=0, json_schema_extra=_DURABILITY, description="with `interval`: the flush period"
    )
    # Snapshots bound the log (disk) and the replay at start-up; 0 turns a trigger off.
    snapshot_every_updates: int = Field(
        default=10_000, ge=0, json_schema_extra=_DURABILITY, description="snapshot after this many updates"
    )
    snapshot_every_seconds: float = Field(
        default=600.0,
        ge=0,
        json_schema_extra=_DURABILITY,
        description="... or when the last one is this old and there are new updates",
    )
    # ... or when the log outgrows a quarter of the table: over max(floor, ratio x the snapshot's bytes).
    # Bounds the log by bytes (records of big pushes are big), whatever the update count, and so the
    # replay at a restart: a snapshot no longer stalls pushes, so it can come often.
    snapshot_log_ratio: float = Field(
        default=0.25,
        ge=0,
        json_schema_extra=_DURABILITY,
        description="... or when the log is over max(`snapshot_log_min_bytes`, this x the snapshot's bytes) "
        "([durability.md](durability.md#what-bounds-disk-use-and-replay-time)); 0: off",
    )
    snapshot_log_min_bytes: int = Field(
        default=64 * MiB,
        ge=0,
        json_schema_extra=_DURABILITY,
        description="... but not before the log holds this many bytes (the floor)",
    )
    snapshot_on_shutdown: bool = Field(
        default=True, json_schema_extra=_DURABILITY, description="snapshot updated tables on a graceful stop"
    )

    # -- limits. Bodies are received whole before a request is admitted (service/http/middleware.py);
    # binary is the bulk format, JSON takes 5-37x its size while decoded into Python objects, hence its
    # own, smaller bound.
    max_body_bytes: int = Field(
        default=64 * MiB,
        ge=1,
        json_schema_extra=_LIMITS,
        description="any request body (the bound for binary, `application/octet-stream`); larger: 413",
    )
    max_json_body_bytes: int = Field(
        default=4 * MiB,
        ge=1,
        json_schema_extra=_LIMITS,
        description="bodies of any other type (parsed as JSON); larger: 413",
    )
    max_body_bytes_held: int = Field(
        default=1 * GiB,
        ge=1,
        json_schema_extra=_LIMITS,
        description="request bodies one worker holds at once (counted as they arrive, until answered), "
        "with the answers its clients have not read yet; over: 503 + Retry-After (an answer over 256 KiB "
        "that finds no room: 503 instead)",
    )
    max_in_flight: int = Field(
        default=64,
        ge=1,
        json_schema_extra=_LIMITS,
        description="requests admitted per worker (once their body has arrived); more: 503 + Retry-After",
    )
    retry_after_s: int = Field(
        default=1, ge=0, json_schema_extra=_LIMITS, description="the Retry-After value"
    )
    max_ids_per_request: int = Field(
        default=1 << 18,
        ge=1,
        json_schema_extra=_LIMITS,
        description="ids in one request (summed over tables in /v1/lookup, /v1/update); more: 422",
    )
    # Bounds the (n, d) rows a request may ask for or push, whatever d is.
    max_values_per_request: int = Field(
        default=1 << 25,
        ge=1,
        json_schema_extra=_LIMITS,
        description="ids x embedding_dim in one request: 422",
    )
    max_tables: int = Field(
        default=64, ge=1, json_schema_extra=_LIMITS, description="tables per server: 422 on create"
    )
    max_embedding_dim: int = Field(
        default=4096, ge=1, json_schema_extra=_LIMITS, description="per table: 422 on create"
    )
    max_memory_size: int = Field(
        default=1 << 28,
        ge=1,
        json_schema_extra=_LIMITS,
        description="float32 values in one table's array: 422 on create",
    )
    max_total_memory_bytes: int = Field(
        default=8 * GiB,
        ge=1,
        json_schema_extra=_LIMITS,
        description="all arrays plus optimizer state: 422 on create",
    )
    body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        json_schema_extra=_LIMITS,
        description="a request's whole body must arrive within this of its headers; else 408, connection "
        "closed",
    )
    # Connections (service/http/protocol.py): uvicorn itself never closes one that sends no request.
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        json_schema_extra=_LIMITS,
        description="a connection must send a request's headers within this of opening or of its last "
        "response; else it is closed",
    )
    keep_alive_timeout_s: int = Field(
        default=5,
        ge=1,
        json_schema_extra=_LIMITS,
        description="a keep-alive connection that sends no byte within this of its last response is closed "
        "(one sweep per worker at most every second: up to 1 s late)",
    )
    max_connections: int = Field(
        default=1000,
        ge=1,
        json_schema_extra=_LIMITS,
        description="open connections per worker; one more is closed as soon as it is accepted",
    )
    # A stop (SIGTERM) must end within Kubernetes' 30 s grace whatever clients hold open: docs/api.md.
    shutdown_grace_s: float = Field(
        default=3.0,
        gt=0,
        json_schema_extra=_LIMITS,
        description="on a stop, requests and gRPC calls under way get this long to finish (each port in "
        "turn), then are cancelled and their connections closed: a stop ends within about 2 x this + "
        "`trace_export_timeout_s` + the shutdown snapshots",
    )
    min_version_wait_ms: float = Field(
        default=1000.0,
        ge=0,
        json_schema_extra=_LIMITS,
        description="a lookup with X-Robez-Min-Version waits this long for that version, then 503",
    )

    # -- replication (service/replication/, docs/replication.md): a replica of tables kept identical
    # through a NATS JetStream log. None = the single-machine mode above.
    nats_url: str | None = Field(
        default=None,
        json_schema_extra=_REPLICATION,
        description="NATS server URL(s), comma-separated; set: replicated mode",
    )
    nats_replicas: int = Field(
        default=3,
        ge=1,
        le=5,
        json_schema_extra=_REPLICATION,
        description="JetStream replication factor of streams and buckets (1 for a single NATS server)",
    )
    replica_name: str | None = Field(
        default=None,
        json_schema_extra=_REPLICATION,
        description="this replica's name (NATS connection name, X-Robez-Replica); none: host name:port",
    )
    nats_prefix: str = Field(
        default="robez",
        pattern=r"^[A-Za-z0-9_-]{1,32}$",
        json_schema_extra=_REPLICATION,
        description="names of streams, buckets and subjects (several robez clusters can share one NATS)",
    )
    # Who robez is to NATS and how it checks NATS (service/natsauth.py, docs/security.md).
    nats_user: str | None = Field(
        default=None, json_schema_extra=_REPLICATION, description="NATS user (with `nats_password`)"
    )
    nats_password: SecretStr | None = Field(
        default=None,
        json_schema_extra=_REPLICATION,
        description="the NATS user's password (from the environment only, never the command line)",
    )
    nats_creds: Path | None = Field(
        default=None, json_schema_extra=_REPLICATION, description="NATS .creds file (JWT + nkey seed)"
    )
    nats_nkey: Path | None = Field(
        default=None, json_schema_extra=_REPLICATION, description="NATS nkey seed file"
    )
    nats_tls_ca: Path | None = Field(
        default=None,
        json_schema_extra=_REPLICATION,
        description="CA bundle the NATS servers' certificates must chain to (set: TLS)",
    )
    nats_tls_cert: Path | None = Field(
        default=None,
        json_schema_extra=_REPLICATION,
        description="client certificate for NATS servers that verify clients (mutual TLS)",
    )
    nats_tls_key: Path | None = Field(
        default=None, json_schema_extra=_REPLICATION, description="... and its private key"
    )
    nats_dedup_window_s: float = Field(
        default=600.0,
        gt=0,
        json_schema_extra=_REPLICATION,
        description="Idempotency-Key retries within this window are applied once",
    )
    nats_publish_timeout_s: float = Field(
        default=10.0,
        gt=0,
        json_schema_extra=_REPLICATION,
        description="wait for a JetStream ack, resends included (then 503; the client resends with its key); "
        "a publish is resent with the same Nats-Msg-Id at once after a reconnect and after a third of this",
    )
    # A hung NATS server keeps its socket open: it is noticed by unanswered pings (about their product).
    nats_ping_interval_s: float = Field(
        default=2.0, gt=0, json_schema_extra=_REPLICATION, description="ping the NATS server this often"
    )
    nats_max_outstanding_pings: int = Field(
        default=2,
        ge=1,
        json_schema_extra=_REPLICATION,
        description="unanswered pings before the NATS server is taken for hung and another node is used",
    )
    apply_wait_s: float = Field(
        default=10.0,
        gt=0,
        json_schema_extra=_REPLICATION,
        description="wait for this replica to apply an acknowledged push (then 503)",
    )
    replica_snapshot_every_updates: int = Field(
        default=10_000,
        ge=0,
        json_schema_extra=_REPLICATION,
        description="upload a snapshot to the Object Store after this many updates (0: never; the log "
        "then grows forever)",
    )
    replica_snapshot_interval_s: float = Field(
        default=300.0,
        ge=0,
        json_schema_extra=_REPLICATION,
        description="... or when the last upload is this old and updated since (0: off)",
    )
    replica_local_snapshot_every_updates: int = Field(
        default=1_000,
        ge=0,
        json_schema_extra=_REPLICATION,
        description="with a data directory: write a local snapshot after this many updates (0: only on a "
        "clean stop)",
    )
    replica_trim_keep: int = Field(
        default=1_000,
        ge=0,
        json_schema_extra=_REPLICATION,
        description="log entries kept below the newest snapshot when trimming",
    )

    # -- telemetry
    log_level: str = Field(
        default="info",
        json_schema_extra=_TELEMETRY,
        description="critical, error, warning, info, debug or trace",
    )
    # One log line per request costs a measurable share of a small lookup; off unless asked for.
    access_log: bool = Field(
        default=False, json_schema_extra=_TELEMETRY, description="uvicorn's line per request"
    )
    max_metric_tables: int = Field(
        default=64,
        ge=1,
        json_schema_extra=_TELEMETRY,
        description="tables per worker with their own `table` label in /metrics; the others share `_other` "
        "(a deleted table's series are removed, freeing its place)",
    )
    # OpenTelemetry's own variables (no ROBEZ_ prefix), read here only to decide whether to trace; the SDK
    # reads the rest itself (service/tracing.py, docs/observability.md).
    otel_traces_exporter: str | None = Field(
        default=None,
        validation_alias="OTEL_TRACES_EXPORTER",
        json_schema_extra=_TELEMETRY,
        description="`otlp` or `console`: trace; `none`: do not",
    )
    otel_exporter_otlp_endpoint: str | None = Field(
        default=None,
        validation_alias=AliasChoices("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"),
        json_schema_extra=_TELEMETRY,
        description="the OTLP collector; set: trace",
    )
    otel_sdk_disabled: bool = Field(
        default=False,
        validation_alias="OTEL_SDK_DISABLED",
        json_schema_extra=_TELEMETRY,
        description="true: never trace",
    )
    trace_export_timeout_s: float = Field(
        default=2.0,
        gt=0,
        json_schema_extra=_TELEMETRY,
        description="one export of spans to the OTLP collector, and the flush at a stop, wait at most "
        "this (over OTEL_EXPORTER_OTLP_TIMEOUT); spans that cannot be sent are dropped",
    )

    # -- advanced: each a default measured once, kept settable for the reason its description gives.
    direct_answers: bool = Field(
        default=True,
        json_schema_extra=_ADVANCED,
        description="small hot-route requests that arrive whole are answered by the connection itself, "
        "without an ASGI task and the middleware stack (same answers, metrics and limits; "
        "[architecture.md](architecture.md#small-requests-the-fast-paths)). Settable so the load test can "
        "measure the stack alone and a suspected difference can be ruled out",
    )
    # Fixed glibc malloc thresholds (robez_core.allocator.keep_freed_buffers).
    malloc_mmap_threshold_mb: int = Field(
        default=32,
        ge=0,
        le=32,
        json_schema_extra=_ADVANCED,
        description="glibc M_MMAP_THRESHOLD per worker, MiB: blocks up to this come from the heap and up to "
        "twice that stays free there, so a large lookup's freed output is reused instead of page-faulted in "
        "on every request (0: glibc's own sliding thresholds). Settable for the load test's allocator "
        "sweep ([loadtest/README.md](loadtest/README.md))",
    )
    max_version_waiters: int = Field(
        default=32,
        ge=1,
        json_schema_extra=_ADVANCED,
        description="lookups per worker waiting for an X-Robez-Min-Version at once; they hold no "
        "`max_in_flight` slot while they wait, so waits never starve other requests; more: 503 at once. "
        "The bound exists so waits cannot pile up without end; raise it only for many readers that each "
        "wait for their own write",
    )
    nats_write_check_interval_s: float = Field(
        default=1.0,
        gt=0,
        json_schema_extra=_ADVANCED,
        description="/readyz?writes=true: a tiny message is published this often, and writes count as "
        "possible while one was acknowledged within a few periods. Shorter: a lost quorum is told sooner, "
        "for more messages on NATS",
    )
    worker_healthcheck_timeout_s: int = Field(
        default=60,
        ge=1,
        json_schema_extra=_ADVANCED,
        description="with several workers, a live worker that does not answer the supervisor's ping for "
        "this long is killed and replaced (a dead one at once); generous, since a worker importing torch "
        "on a busy machine can take seconds to answer its first ping",
    )

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
