"""robez's supervisor of its worker processes (``robez serve --workers N``, N > 1).

uvicorn's own supervisor checks its workers one after the other with a blocking ping: while it waits up
to ``timeout_worker_healthcheck`` (60 s) for one worker's answer it restarts nobody else, and a worker
killed while it was being pinged is only noticed when that wait runs out, because the parent holds both
ends of the ping pipe. Killing worker 1, then its replacement while it started, then worker 2 left no
worker at all for about a minute (issue 15.2).

This one never blocks on a worker. Every ``check_interval_s`` it looks at each worker in turn:

- a worker whose process has exited is replaced at once (after a short back-off when replacements keep
  dying young, so a crash loop does not spin); a worker that failed before it started serving
  (uvicorn's ``STARTUP_FAILURE`` exit status: the app, the socket or the tables are broken and a restart
  would fail the same way) stops the server, as uvicorn does;
- a live worker is pinged over a pipe that only the worker holds the other end of, and its answer is
  read later without waiting: one silent for ``healthcheck_timeout_s`` (hung, or stopped) is killed and
  replaced. A dead worker's pipe reads as closed at once.

The workers are the same uvicorn ``Server`` over the same listening socket as uvicorn's; SIGINT / SIGTERM
stop them all (SIGTERM, then a wait for their graceful shutdown).

Workers are forked from a fork server (multiprocessing's ``forkserver``) that imported the app once
(``service.forkserver``: torch, numba, the kernels' module; ~2.8 s of CPU and ~230 MB of heap in each
spawned worker before): a worker, or the replacement of a dead one, starts in milliseconds and shares
those pages with its siblings. The fork server is a fresh process (a fork of the supervisor would copy
whatever its threads held), started before the tables are loaded (``run(prepare)``), so its import
overlaps the load: a restart of a big table costs the load, not the load plus the import
(docs/benchmarks/big-tables-*.md). It ignores SIGTERM (a stop sent to the whole process group leaves
the stopping to this supervisor, which waits for the workers' graceful shutdown) and exits with this
process; a worker dies with the fork server (``PR_SET_PDEATHSIG``), so a fork server that is killed
leaves no worker running unsupervised: the workers are replaced from a new one.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import FrameType

import uvicorn
from uvicorn.config import STARTUP_FAILURE

logger = logging.getLogger("robez.supervisor")

multiprocessing.allow_connection_pickling()  # the listening sockets go to each started worker
# The fork server starts with this process's environment at that moment: ``robez serve`` sets the
# workers' (the ``ROBEZ_*`` settings, the shared directory) before it supervises.
_workers_context = multiprocessing.get_context("forkserver")
_workers_context.set_forkserver_preload(["service.forkserver"])
_PR_SET_PDEATHSIG = 1
# Workers that died younger than this count as failed starts for the back-off.
_YOUNG_DEATH_S = 10.0
_MAX_BACKOFF_S = 10.0
_PING_EVERY_S = 1.0
_STOP_WAIT_S = 120.0  # a graceful stop may write a snapshot per table


def _answer_pings(conn: Connection) -> None:
    """In a worker: answer every ping from the supervisor, until it goes away."""
    try:
        while True:
            conn.recv()
            conn.send(b"pong")
    except (EOFError, OSError):
        return


def _die_with_the_fork_server() -> None:
    """SIGKILL this worker when its parent, the fork server, dies: the supervisor then sees every worker
    gone (it reads their exit through the fork server) and starts new ones, with no old one left serving."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _worker_main(config: uvicorn.Config, sockets: list[socket.socket], conn: Connection) -> None:
    """A worker process, forked once the tables are loaded: answer pings on a thread, load the app (its
    imports are the fork server's), then serve ``config``'s app on the inherited sockets."""
    _die_with_the_fork_server()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the fork server's SIG_IGN, until uvicorn's handler
    config.configure_logging()
    # The server's logging.basicConfig (cli.serve) does not reach a worker (the fork server is a new
    # process): without this, robez's own loggers ("robez.*") printed warnings alone, bare, whatever
    # ROBEZ_LOG_LEVEL said.
    level = config.log_level
    logging.basicConfig(
        level=level.upper() if isinstance(level, str) else (level or logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    threading.Thread(target=_answer_pings, args=(conn,), name="robez-pong", daemon=True).start()
    with contextlib.suppress(KeyboardInterrupt):  # a Ctrl-C reaches the supervisor, which stops us too
        try:
            config.load()  # what uvicorn would do first: build the app
        except (Exception, SystemExit) as exc:
            # The app, its TLS files or its protocol are broken: a replacement would fail the same way
            # (a bad key respawned workers forever, issue 40.4). uvicorn's status says "do not restart".
            if isinstance(exc, SystemExit) and exc.code in (0, None):
                raise
            logger.error("worker start-up failed: %s: %s", type(exc).__name__, exc)
            sys.exit(STARTUP_FAILURE)
        uvicorn.Server(config).run(sockets=sockets)


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection
    started: float = field(default_factory=time.monotonic)
    last_answer: float = field(default_factory=time.monotonic)
    ping_sent: float | None = None

    def check(self, now: float, timeout_s: float) -> str | None:
        """Why this worker must be replaced (dead, hung), or None; never waits."""
        if not self.process.is_alive():
            return f"exited with status {self.process.exitcode}"
        try:
            while self.conn.poll(0):
                self.conn.recv()
                self.ping_sent, self.last_answer = None, now
            if self.ping_sent is None and now - self.last_answer >= _PING_EVERY_S:
                self.conn.send(b"ping")
                self.ping_sent = now
        except (EOFError, OSError):
            return "closed its health pipe (died)"
        if self.ping_sent is not None and now - self.ping_sent > timeout_s:
            return f"did not answer a health check within {timeout_s:g} s"
        return None


class WorkerSupervisor:
    """Start ``workers`` uvicorn workers of ``config`` on ``sockets`` and keep that many running.

    Args:
        config: the uvicorn config every worker serves (its app an import string).
        sockets: the listening sockets, bound by this process and inherited by every worker.
        workers: how many workers to keep.
        healthcheck_timeout_s: a live worker silent this long is killed and replaced.
        check_interval_s: how often every worker is looked at.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        sockets: list[socket.socket],
        workers: int,
        healthcheck_timeout_s: float,
        check_interval_s: float = 0.2,
    ) -> None:
        self.config = config
        self.sockets = sockets
        self.num_workers = workers
        self.healthcheck_timeout_s = healthcheck_timeout_s
        self.check_interval_s = check_interval_s
        self.should_exit = threading.Event()
        self.workers: list[_Worker | None] = []
        self._young_deaths = [0] * workers
        self._restart_at = [0.0] * workers
        self.exit_status = 0

    def _spawn(self) -> _Worker:
        parent_conn, child_conn = _workers_context.Pipe()
        process = _workers_context.Process(
            target=_worker_main,
            kwargs={"config": self.config, "sockets": self.sockets, "conn": child_conn},
            name="robez-worker",
        )
        process.start()
        child_conn.close()  # the worker holds the only other end: its death closes the pipe
        return _Worker(process, parent_conn)

    def run(self, prepare: Callable[[], None] = lambda: None) -> int:
        """Start the fork server, run ``prepare`` (the tables' load) while it imports the app, start the
        workers, and supervise until SIGINT / SIGTERM (or a worker's start-up failure); returns the exit
        status. What ``prepare`` raises is raised here, once the workers are stopped."""
        try:
            forkserver.ensure_running()  # returns at once; the fork server imports while the tables load
            prepare()
            self.workers = [self._spawn() for _ in range(self.num_workers)]
        except BaseException:  # the load failed, or a SIGTERM during it (the caller's handler raises)
            self._stop_all()
            raise
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            logger.info(
                "supervising %d workers (pids %s)",
                self.num_workers,
                ", ".join(str(w.process.pid) for w in self.workers if w is not None),
            )
            while not self.should_exit.wait(self.check_interval_s):
                self.check_workers()
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self.exit_status

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        logger.info("received %s, stopping the workers", signal.Signals(signum).name)
        self.should_exit.set()

    def check_workers(self) -> None:
        """One round: replace every worker that is dead or hung (none of them waited on)."""
        now = time.monotonic()
        for slot, worker in enumerate(self.workers):
            if self.should_exit.is_set():
                return
            if worker is None:  # waiting out a back-off (or a failed spawn)
                if now >= self._restart_at[slot]:
                    self._replace(slot, now)
                continue
            problem = worker.check(now, self.healthcheck_timeout_s)
            if problem is None:
                if now - worker.started > 3 * _YOUNG_DEATH_S:
                    self._young_deaths[slot] = 0
                continue
            self._retire(worker)
            if worker.process.exitcode == STARTUP_FAILURE:
                logger.error("worker [%s] failed to start; stopping the server", worker.process.pid)
                self.exit_status = STARTUP_FAILURE
                self.should_exit.set()
                return
            young = now - worker.started < _YOUNG_DEATH_S
            self._young_deaths[slot] = self._young_deaths[slot] + 1 if young else 0
            delay = self._backoff(self._young_deaths[slot])
            logger.warning(
                "worker [%s] %s; replacing it%s",
                worker.process.pid,
                problem,
                f" in {delay:g} s ({self._young_deaths[slot]} died young in a row)" if delay else "",
            )
            self.workers[slot] = None
            self._restart_at[slot] = now + delay
            if not delay:
                self._replace(slot, now)

    def _replace(self, slot: int, now: float) -> None:
        """Start the worker of an empty slot; if the OS refuses (out of processes or memory), try again
        in a second rather than stop supervising the others."""
        try:
            worker = self._spawn()
        except OSError as error:
            logger.error("cannot start a worker (%s); trying again in 1 s", error)
            self._restart_at[slot] = now + 1.0
            return
        self.workers[slot] = worker
        logger.info("started worker [%s]", worker.process.pid)

    @staticmethod
    def _backoff(young_deaths: int) -> float:
        """No wait for the first two replacements that die young in a row, then 0.5 s doubling to 10 s."""
        return 0.0 if young_deaths <= 2 else min(_MAX_BACKOFF_S, 0.5 * 2.0 ** (young_deaths - 3))

    @staticmethod
    def _retire(worker: _Worker) -> None:
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=10)
        worker.conn.close()

    def _stop_all(self) -> None:
        live = [w for w in self.workers if w is not None and w.process.is_alive()]
        for worker in live:
            worker.process.terminate()
        deadline = time.monotonic() + _STOP_WAIT_S
        for worker in live:
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                logger.error("worker [%s] did not stop in %g s; killing it", worker.process.pid, _STOP_WAIT_S)
                worker.process.kill()
                worker.process.join(timeout=10)
        for slot in self.workers:
            if slot is not None:
                slot.conn.close()


def run_workers(
    config: uvicorn.Config, workers: int, healthcheck_timeout_s: float, prepare: Callable[[], None]
) -> int:
    """Bind ``config``'s socket here and supervise ``workers`` workers on it, started while ``prepare``
    runs (``WorkerSupervisor.run``); returns the exit status."""
    sock = config.bind_socket()
    try:
        return WorkerSupervisor(config, [sock], workers, healthcheck_timeout_s).run(prepare)
    finally:
        sock.close()
