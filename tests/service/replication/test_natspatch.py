"""The nats-py patch (service/replication/natspatch.py) is applied only to the nats-py it was read
against: any other version is refused with an error that names it."""

from __future__ import annotations

import pytest
from nats.aio.transport import TcpTransport

from service.replication.natspatch import (
    UnsupportedNatsPy,
    bound_tls_close,
    check_nats_py,
    nats_py_version,
)


def test_the_installed_nats_py_is_in_the_tested_range() -> None:
    check_nats_py()  # pyproject.toml's bound and natspatch.TESTED agree with what is installed


@pytest.mark.parametrize("installed", ["2.8.0", "2.17.0", "3.0.0", "unknown", "2"])
def test_an_unknown_nats_py_is_refused_by_name(installed: str) -> None:
    with pytest.raises(UnsupportedNatsPy, match=f"nats-py {installed} "):
        check_nats_py(installed)


def test_the_patch_is_applied_once() -> None:
    bound_tls_close()
    patched = TcpTransport.wait_closed
    assert getattr(patched, "_robez_bounded", False)
    bound_tls_close()
    assert TcpTransport.wait_closed is patched
    assert nats_py_version() != "unknown"
