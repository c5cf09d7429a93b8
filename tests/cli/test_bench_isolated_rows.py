"""The isolated device's restart row waits for each answer a bounded time: a restart that never
comes fails the row with a message naming the message it waited on, instead of hanging the
bench."""

from __future__ import annotations

from typing import Any

import pykka
import pytest

from xlog_actors.cli.bench import rows_isolated


class _Silent:
    """An actor ref that never answers: every ask with a timeout times out, and one without a
    timeout would wait for ever (here it fails the test instead)."""

    def __init__(self) -> None:
        self.timeouts: list[float | None] = []

    def ask(self, message: Any, timeout: float | None = None) -> Any:
        self.timeouts.append(timeout)
        if timeout is None:
            raise AssertionError(f"asked {type(message).__name__} with no timeout: the bench would hang here")
        raise pykka.Timeout(f"{timeout} seconds")


@pytest.mark.timeout(30)
def test_a_restart_that_never_comes_fails_the_row_instead_of_hanging(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rows_isolated.time, "sleep", lambda s: None)  # the reserve child's boot wait
    silent = _Silent()
    fixture = rows_isolated._Isolated(silent, silent, silent, 1, "host")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="no answer to ChildFault within 60 s: the device did not restart"):
        rows_isolated._restarts(fixture, None)  # type: ignore[arg-type]
    assert silent.timeouts == [rows_isolated.ANSWER_TIMEOUT_S]
