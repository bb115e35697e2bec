"""What `make container-test` and `make k8s-test` share (deploy/container_test/common.py): one run at a
time on the engine state folder, and the summary block they record in the docs."""

from __future__ import annotations

from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@pytest.fixture
def common(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(DEPLOY))  # deploy/, as the make targets run the tools
    import signal

    from container_test import common as module

    monkeypatch.setattr(signal, "signal", lambda *args: None)  # the test process keeps its handlers
    return module


def test_a_second_run_on_the_same_state_folder_is_refused(
    common, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    first = common.begin_run("container-test", "apt-get", tmp_path / "state", 60)
    assert first is not None
    try:
        assert common.begin_run("k8s-test", "apt-get", tmp_path / "state", 60) is None
        assert "another container-test or k8s-test holds" in capsys.readouterr().err
    finally:
        first[1].close()
    again = common.begin_run("k8s-test", "apt-get", tmp_path / "state", 60)
    assert again is not None
    again[1].close()


def test_the_summary_replaces_only_its_block(common, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    record = tmp_path / "doc.md"
    record.write_text("before\n<!-- b -->\nold\n<!-- e -->\nafter\n")
    common.write_summary(["one", "two"], record, "<!-- b -->", "<!-- e -->")
    assert record.read_text() == "before\n<!-- b -->\n```\none\ntwo\n```\n<!-- e -->\nafter\n"
    with pytest.raises(common.Failure, match="no <!-- x -->"):
        common.write_summary(["one"], record, "<!-- x -->", "<!-- e -->")
