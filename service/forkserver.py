"""What the fork server of ``robez serve --workers N`` imports before it forks a worker
(``service.supervisor``): the app and all it imports, once for every worker.

Imported as the fork server's preload only: it also makes that process ignore SIGTERM, so a SIGTERM sent to
the server's whole process group (systemd, a terminal) leaves the stopping to the supervisor, which
waits for the workers' graceful shutdown; the fork server exits when the supervisor does. A worker sets
SIGTERM back to its default when it starts.
"""

from __future__ import annotations

import signal

from . import app  # noqa: F401  (torch, numba, the kernels' module: seconds of CPU, shared by the forks)

signal.signal(signal.SIGTERM, signal.SIG_IGN)
