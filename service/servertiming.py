"""Reading the ``Server-Timing`` header robez answers with (``service/metrics.py`` writes it): one parser
for the client (``RobezClient.last_timing``) and the load test. No third-party imports, so the load
test's client processes stay light."""

from __future__ import annotations

import contextlib


def parse_server_timing(header: str | None) -> dict[str, float]:
    """Parses ``Server-Timing: hash;dur=0.1, lookup;dur=0.5, total;dur=0.7`` into {name: ms}.

    Entries without a readable ``dur`` are skipped; an absent header gives ``{}``.
    """
    timing: dict[str, float] = {}
    if not header:
        return timing
    for entry in header.split(","):
        name, *params = (part.strip() for part in entry.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if name and key.strip().lower() == "dur":
                with contextlib.suppress(ValueError):
                    timing[name] = float(value.strip().strip('"'))
    return timing
