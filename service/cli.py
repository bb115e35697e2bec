"""The ``robez`` command: ``robez serve`` runs the HTTP service; ``robez import`` and ``robez snapshot``
are offline tools for a data directory (no server may hold it; see docs/durability.md).

``robez serve`` prepares the shared tables once (loading the data directory and the tables file), then
starts uvicorn with N worker processes that all attach to them, and removes the shared memory when
uvicorn returns (Ctrl-C / SIGTERM). Options override ``ROBEZ_*`` environment variables.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import ssl
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from robez_core.errors import ConfigError, RobezError

from .config import Settings

logger = logging.getLogger("robez.cli")

# CLI option -> Settings field; each is passed on to the workers as ROBEZ_<FIELD>.
_APP = "service.app:create_app_from_env"  # uvicorn's factory: each worker builds its app from ROBEZ_*
_SERVE_OPTIONS = (
    "host",
    "port",
    "grpc_port",
    "grpc_engine",
    "workers",
    "config",
    "data_dir",
    "log_level",
    "threads_per_worker",
    "nats_url",
    "nats_replicas",
    "replica_name",
    "nats_user",
    "nats_creds",
    "nats_nkey",
    "nats_tls_ca",
    "nats_tls_cert",
    "nats_tls_key",
    "tls_cert",
    "tls_key",
    "tls_client_ca",
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="robez",
        description="ROBE-Z compressed embedding tables: an HTTP lookup and online-training service.",
        epilog="Every option can also be set as ROBEZ_<OPTION> (e.g. ROBEZ_PORT=9000); see docs/api.md.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve tables over HTTP",
        description="Serve tables over HTTP. With no --config and no tables in --data-dir it serves the "
        "built-in table 'demo' (d=64, Z=32, m=262144).",
    )
    serve.add_argument("--host", help="bind address (default 127.0.0.1; ROBEZ_HOST)")
    serve.add_argument("--port", type=int, help="TCP port (default 8000; ROBEZ_PORT)")
    serve.add_argument(
        "--grpc-port",
        dest="grpc_port",
        type=int,
        help="also serve the inference protocol v2 over gRPC on this port, from every worker "
        "(default: off; ROBEZ_GRPC_PORT); see docs/api.md",
    )
    serve.add_argument(
        "--grpc-engine",
        dest="grpc_engine",
        choices=("grpcio", "frames"),
        help="what serves --grpc-port: frames, robez's own HTTP/2 (default), or grpcio (ROBEZ_GRPC_ENGINE)",
    )
    serve.add_argument(
        "--workers",
        type=int,
        help="worker processes sharing one copy of every table (default 1; ROBEZ_WORKERS)",
    )
    serve.add_argument("--config", type=Path, help="tables file, TOML (ROBEZ_CONFIG); format in docs/api.md")
    serve.add_argument(
        "--data-dir",
        dest="data_dir",
        type=Path,
        help="directory for snapshots and the write-ahead log; tables survive restarts (ROBEZ_DATA_DIR)",
    )
    serve.add_argument(
        "--log-level", dest="log_level", help="critical|error|warning|info|debug (ROBEZ_LOG_LEVEL)"
    )
    serve.add_argument(
        "--threads-per-worker",
        dest="threads_per_worker",
        type=int,
        help="kernel threads per worker (default: CPUs // workers; ROBEZ_THREADS_PER_WORKER)",
    )
    serve.add_argument(
        "--nats",
        dest="nats_url",
        metavar="URL[,URL...]",
        help="run as a replica: tables are kept identical with every other replica through a NATS "
        "JetStream log at these servers (ROBEZ_NATS_URL); see docs/replication.md",
    )
    serve.add_argument(
        "--nats-replicas",
        dest="nats_replicas",
        type=int,
        help="JetStream replication factor of the tables' logs (default 3; 1 for a single NATS server; "
        "ROBEZ_NATS_REPLICAS)",
    )
    serve.add_argument(
        "--replica-name",
        dest="replica_name",
        help="this replica's name in NATS (default: host name:port; ROBEZ_REPLICA_NAME)",
    )
    _add_tls_options(serve)
    _add_durability_commands(commands)
    return parser


def serve_options() -> dict[str, list[str]]:
    """Settings field -> the ``robez serve`` options that set it (docs/configuration.md lists them)."""
    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    return {
        action.dest: list(action.option_strings)
        for action in serve._actions
        if action.option_strings and action.dest in _SERVE_OPTIONS
    }


def _add_tls_options(serve: argparse.ArgumentParser) -> None:
    """Credentials and certificates: NATS's (replicated mode) and the HTTP port's; docs/security.md."""
    nats = serve.add_argument_group(
        "NATS authentication and TLS",
        "One of --nats-user (password in ROBEZ_NATS_PASSWORD, never on the command line), --nats-creds, "
        "--nats-nkey; and the CA that the NATS servers' certificates chain to.",
    )
    nats.add_argument("--nats-user", dest="nats_user", help="NATS user (ROBEZ_NATS_USER)")
    nats.add_argument("--nats-creds", dest="nats_creds", type=Path, help=".creds file (ROBEZ_NATS_CREDS)")
    nats.add_argument("--nats-nkey", dest="nats_nkey", type=Path, help="nkey seed file (ROBEZ_NATS_NKEY)")
    nats.add_argument("--nats-tls-ca", dest="nats_tls_ca", type=Path, help="CA bundle (ROBEZ_NATS_TLS_CA)")
    nats.add_argument(
        "--nats-tls-cert", dest="nats_tls_cert", type=Path, help="client certificate (ROBEZ_NATS_TLS_CERT)"
    )
    nats.add_argument(
        "--nats-tls-key", dest="nats_tls_key", type=Path, help="its private key (ROBEZ_NATS_TLS_KEY)"
    )
    http = serve.add_argument_group("HTTPS", "Serve HTTPS instead of plain HTTP on --port.")
    http.add_argument(
        "--tls-cert", dest="tls_cert", type=Path, help="server certificate, PEM (ROBEZ_TLS_CERT)"
    )
    http.add_argument("--tls-key", dest="tls_key", type=Path, help="its private key, PEM (ROBEZ_TLS_KEY)")
    http.add_argument(
        "--tls-client-ca",
        dest="tls_client_ca",
        type=Path,
        help="require client certificates signed by this CA (ROBEZ_TLS_CLIENT_CA)",
    )


def _add_durability_commands(commands: Any) -> None:
    """``robez import`` / ``robez snapshot``: offline, on a data directory no server is using."""
    from .wal import CHECKPOINT_FORMATS

    load = commands.add_parser(
        "import",
        help="load a checkpoint into a table of a data directory (server stopped)",
        description="Write a robez checkpoint (safetensors) or a torch.save file of the paper's "
        "RobezEmbedding state_dict (read with weights_only=True) as a table at version 0. For a running "
        "server use POST /v1/tables/{name}/load.",
    )
    load.add_argument("checkpoint", type=Path, help="the .safetensors or .pt file")
    load.add_argument("--data-dir", dest="data_dir", type=Path, required=True)
    load.add_argument("--table", required=True, help="table name")
    load.add_argument(
        "--format", choices=CHECKPOINT_FORMATS, default="auto", help="auto: .pt files are paper"
    )
    load.add_argument("--replace", action="store_true", help="overwrite an existing table")
    load.add_argument("--num-embeddings", dest="num_embeddings", type=int, help="paper: the module's n")
    load.add_argument("--chunk-size", dest="chunk_size", type=int, help="paper: Z (needed when d <= Z)")
    load.add_argument("--val-offset", dest="val_offset", type=int, default=0, help="paper: val_offset")
    load.add_argument("--prefix", help="paper: key prefix of the module in a model's state_dict")
    load.add_argument(
        "--optimizer", choices=("sgd", "adagrad", "adam"), help="paper, --compress-to: the table's optimizer"
    )
    load.add_argument("--lr", type=float, help="paper, --compress-to: the optimizer's lr")
    load.add_argument(
        "--compress-to",
        dest="compress_to",
        type=int,
        metavar="M",
        help="the checkpoint is a trained full (n, d) table (safetensors, or a torch.save state_dict such as "
        "nn.Embedding's): compress it into a ROBE-Z array of M floats (each slot the mean of the values "
        "hashed to it) with --chunk-size (default 32), --val-offset and --optimizer/--lr (default sgd)",
    )
    load.add_argument(
        "--key", help="--compress-to: the tensor's name when the file holds several 2-D tensors"
    )
    snapshot = commands.add_parser(
        "snapshot",
        help="replay tables' logs into fresh snapshots, checking every file (server stopped)",
        description="Compact a data directory: load each table (snapshot + log, which also checks every "
        "checksum) and write a new snapshot. For a running server use POST /v1/tables/{name}/snapshot.",
    )
    snapshot.add_argument("--data-dir", dest="data_dir", type=Path, required=True)
    snapshot.add_argument("--table", action="append", help="only this table (repeatable); default: all")
    snapshot.add_argument(
        "--salvage",
        action="store_true",
        help="when a log is damaged in the middle, keep the updates before the damage and give up the rest",
    )


def _durability_command(args: argparse.Namespace) -> int:
    from robez_core.config import OptimizerConfig

    from .store import validate_table_name
    from .wal import import_offline, snapshot_offline

    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    _refuse_replica_dir(
        args.data_dir,
        "a replica's tables come from the replicated log and the Object Store, and the replicas take "
        "their snapshots themselves (docs/replication.md)",
    )
    if args.command == "snapshot":
        for name in args.table or []:
            validate_table_name(name)
        for name, version, replayed in snapshot_offline(args.data_dir, args.table, salvage=args.salvage):
            print(f"{name}: snapshot at version {version} ({replayed} logged updates folded in)")
        return 0
    optimizer = None
    if args.optimizer is not None or args.lr is not None:
        default = OptimizerConfig()
        optimizer = OptimizerConfig(name=args.optimizer or default.name, lr=args.lr or default.lr)
    data, format = args.checkpoint.read_bytes(), args.format
    if args.compress_to is not None:
        from .full_import import compress_full_checkpoint, table_bytes

        compressed = compress_full_checkpoint(
            data,
            args.compress_to,
            key=args.key,
            chunk_size=args.chunk_size or 32,
            val_offset=args.val_offset,
            optimizer=optimizer,
        )
        print(
            f"compressed a full {compressed.config.num_embeddings} x {compressed.config.embedding_dim} table "
            f"{compressed.config.compression_ratio:.1f}x into {args.compress_to} floats"
        )
        data, format = table_bytes(compressed), "robez"
    table, kind = import_offline(
        args.data_dir,
        validate_table_name(args.table),
        data,
        replace=args.replace,
        format=format,
        num_embeddings=args.num_embeddings,
        chunk_size=args.chunk_size,
        val_offset=args.val_offset,
        prefix=args.prefix,
        optimizer=optimizer,
    )
    config = table.config
    print(
        f"{args.table}: imported a {kind} checkpoint (m={config.memory_size}, d={config.embedding_dim}, "
        f"Z={config.chunk_size}, optimizer {table.optimizer.name}) at version 0"
    )
    return 0


def _settings_from(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {
        name: getattr(args, name) for name in _SERVE_OPTIONS if getattr(args, name) is not None
    }
    return Settings(**overrides)


def _environment_for_workers(settings: Settings, shm_path: Path) -> dict[str, str]:
    """What the workers' ``Settings()`` must read to equal ours (secrets are already in the env), the
    shared directory they attach to, and gRPC core's settings when they serve gRPC (``GRPC_EXPERIMENTS``,
    unless set: gRPC reads it when imported, after this)."""
    from .app import WORKER_SHM_VARIABLE

    env = {
        f"ROBEZ_{name.upper()}": str(value)
        for name in _SERVE_OPTIONS
        if (value := getattr(settings, name)) is not None
    }
    env[WORKER_SHM_VARIABLE] = str(shm_path)
    if settings.grpc_port is not None and "GRPC_EXPERIMENTS" not in os.environ:
        from .grpc import GRPC_EXPERIMENTS  # the package's __init__: no import of grpc itself

        env["GRPC_EXPERIMENTS"] = GRPC_EXPERIMENTS
    if settings.workers > 1:
        # prometheus_client reads this when imported in each (spawned) worker: samples go to shared files.
        metrics_dir = shm_path / "metrics"
        metrics_dir.mkdir(exist_ok=True)
        env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    return env


def _refuse_replica_dir(data_dir: Path, advice: str) -> None:
    """``ConfigError`` if ``data_dir`` is a replica's (``robez serve --nats``): single-server commands
    (``serve`` without --nats, ``import``, ``snapshot``) would take its local snapshots for a write-ahead
    log's tables, or write a log beside them that no replica reads."""
    from .replication.localsnap import is_replica_dir

    if is_replica_dir(data_dir):
        raise ConfigError(
            f"the data directory {data_dir} is a replica's (--nats): its local snapshots are no "
            f"single-server write-ahead log; {advice}"
        )


def serve(settings: Settings) -> int:
    """Take the data directory, prepare the shared tables, run uvicorn until it is stopped, clean up;
    returns an exit status. Raises ``ConflictError`` if another server holds the data directory."""
    from .tls import check_files
    from .wal import ServerLock

    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    check_files(settings)  # a bad certificate, key or CA stops the start here, before the tables load
    if settings.data_dir is not None:
        from .replication.localsnap import LocalSnapshots

        if settings.nats_url is not None:
            LocalSnapshots(settings.data_dir)  # refuses a single server's directory, marks it a replica's
        else:
            _refuse_replica_dir(settings.data_dir, "give this server its own data directory")
    # Held until the workers are gone: a second server on the directory fails here, before it loads.
    server_lock = ServerLock(settings.data_dir) if settings.data_dir is not None else None
    try:
        return _serve_locked(settings)
    finally:
        if server_lock is not None:
            server_lock.release()


def _serve_locked(settings: Settings) -> int:
    import uvicorn

    from .app import open_journal
    from .faults import Faults
    from .http.protocol import uvicorn_options
    from .log.journal import NullJournal
    from .replication.replica import local_settings
    from .shm import SharedDirectory
    from .store import TableStore
    from .supervisor import run_workers

    replicated = settings.nats_url is not None
    faults = Faults.from_environment()  # testing only (service/faults.py): read here and in each worker
    # A replica starts with no tables: its applier creates them from the replicated log.
    journal = NullJournal() if replicated else open_journal(settings, faults)
    try:
        directory = SharedDirectory.create(settings.shm_dir)
    except BaseException:
        journal.close()
        raise

    def load_tables() -> None:
        try:
            TableStore.fill(directory, local_settings(settings) if replicated else settings, journal, faults)
        finally:
            # Each worker opens its own journal; this one only loaded the tables.
            journal.close()

    # uvicorn re-raises a SIGTERM once it has shut down; with the default action that would end the
    # process before the ``finally`` below removes the shared tables from /dev/shm (a SIGTERM while the
    # tables load stops the start the same way). A stop asked for is a clean exit, 0, whatever the
    # worker count (the supervisor of several workers returns 0 too).
    previous_sigterm = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        os.environ.update(_environment_for_workers(settings, directory.path))
        _warn_if_too_few_file_descriptors(settings.max_connections)
        logger.info(
            "shared tables in %s; %d worker(s) x %d kernel thread(s)",
            directory.path,
            settings.workers,
            settings.kernel_threads(),
        )
        options: dict[str, Any] = {
            "factory": True,
            "host": settings.host,
            "port": settings.port,
            "workers": settings.workers,
            "log_level": settings.log_level,
            "access_log": settings.access_log,
            "timeout_worker_healthcheck": settings.worker_healthcheck_timeout_s,
            **uvicorn_options(settings),
            **_tls_options(settings),
        }
        if settings.workers == 1:
            load_tables()
            uvicorn.run(_APP, **options)
            return 0
        # Several workers: robez's own supervisor, which never waits on one worker while others are down;
        # it starts them while the tables load.
        config = uvicorn.Config(_APP, **options)
        return run_workers(config, settings.workers, settings.worker_healthcheck_timeout_s, load_tables)
    except _SigtermStop:
        logger.info("stopped on SIGTERM")
        return 0
    finally:
        journal.close()  # already closed once the tables loaded; not if the start failed before
        directory.remove()
        signal.signal(signal.SIGTERM, previous_sigterm)


def _tls_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's TLS options: HTTPS with the server certificate, and client certificates required when a
    client CA is given."""
    if settings.tls_cert is None:
        return {}
    options: dict[str, Any] = {"ssl_certfile": str(settings.tls_cert), "ssl_keyfile": str(settings.tls_key)}
    if settings.tls_client_ca is not None:
        options["ssl_ca_certs"] = str(settings.tls_client_ca)
        options["ssl_cert_reqs"] = ssl.CERT_REQUIRED
    return options


# Descriptors a worker needs besides its connections: logs, snapshots, shared memory, the listening socket.
_RESERVED_FILE_DESCRIPTORS = 128


def _warn_if_too_few_file_descriptors(max_connections: int) -> None:
    """Each worker (inheriting this limit) must be able to open ``max_connections`` sockets and its files."""
    try:
        import resource
    except ImportError:  # not on Unix
        return
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < max_connections + _RESERVED_FILE_DESCRIPTORS:
        logger.warning(
            "the open-file limit (%d) is below max_connections=%d + %d for the tables' files: raise it "
            "(ulimit -n) or lower ROBEZ_MAX_CONNECTIONS, or connections may fail at accept",
            soft,
            max_connections,
            _RESERVED_FILE_DESCRIPTORS,
        )


class _SigtermStop(BaseException):
    """Raised by the SIGTERM handler: unwinds ``_serve_locked`` (its clean-up runs) to a clean exit."""


def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise _SigtermStop


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``robez`` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command in ("import", "snapshot"):
        try:
            return _durability_command(args)
        except (RobezError, OSError) as exc:
            print(f"robez {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
    if args.command != "serve":
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        settings = _settings_from(args)
        return serve(settings)
    except ValidationError as exc:
        print(f"robez: invalid setting: {exc}", file=sys.stderr)
        return 2
    except RobezError as exc:
        print(f"robez: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
