"""The bench sets the environment's stack settings aside while it runs: every row measures the
stack it names, whatever ``XLOG_ACTORS_RESOURCE`` or ``XLOG_ACTORS_LOG`` say (a block cache as
the default would change what the default-stack rows measure, and leave a row that injects a
fault on a free waiting); they are back once it is done, even when it fails."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from xlog_actors.cli import bench
from xlog_actors.cli import main as cli_main
from xlog_actors.memory.stack import LOG_ENV, RESOURCE_ENV


def test_the_run_sees_no_stack_settings_and_they_come_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(RESOURCE_ENV, "async+cache")
    monkeypatch.setenv(LOG_ENV, str(tmp_path / "log.csv"))
    seen: list[tuple[str | None, str | None]] = []
    real = bench.collect

    def collect(*args: Any) -> Any:
        seen.append((os.environ.get(RESOURCE_ENV), os.environ.get(LOG_ENV)))
        return real(*args)

    monkeypatch.setattr(bench, "collect", collect)
    assert cli_main(["bench", "--driver", "host", "--quick", "--only", "DeviceClient allocate+free"]) == 0
    assert seen == [(None, None)]
    assert os.environ[RESOURCE_ENV] == "async+cache" and os.environ[LOG_ENV] == str(tmp_path / "log.csv")
    err = capsys.readouterr().err
    assert f"{LOG_ENV}, {RESOURCE_ENV} set aside for the run" in err
    assert not (tmp_path / "log.csv").exists()  # nothing was logged through the environment's stack


def test_the_settings_come_back_when_the_run_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RESOURCE_ENV, "direct")

    def collect(*args: Any) -> Any:
        raise RuntimeError("a row broke the run")

    monkeypatch.setattr(bench, "collect", collect)
    with pytest.raises(RuntimeError, match="a row broke the run"):
        bench.run_bench(bench_args())
    assert os.environ[RESOURCE_ENV] == "direct"


def bench_args() -> Any:
    from argparse import Namespace

    return Namespace(driver="host", quick=True, json=None, only=None, ray=False)
