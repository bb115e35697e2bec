"""An app under a real uvicorn in a thread of the test process, on a free loopback port: for clients that
need a socket (tritonclient, a download's first byte: TestClient hands a body over only once it is whole)
while the test still reaches the app's store in memory."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from service.app import create_app

from .conftest import make_settings


class ThreadedServer:
    """``app`` served on 127.0.0.1 at a free port until ``stop``; ``address`` is host:port, ``url`` its
    http:// form. ``options``: more ``uvicorn.Config`` arguments (``protocol.uvicorn_options(settings)``:
    robez serve's own HTTP protocol)."""

    def __init__(self, app: FastAPI, **options: Any) -> None:
        self.app = app
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", **options)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        self.url = f"http://{self.address}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def app_server(tmp_path: Path, **settings: Any) -> ThreadedServer:
    """The app of ``make_settings(tmp_path, **settings)`` (the ``demo`` table unless told otherwise),
    served in a thread."""
    return ThreadedServer(create_app(make_settings(tmp_path, **settings)))
