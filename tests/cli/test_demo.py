"""The main job: the demo pipeline and the ``info``/``demo`` commands."""

from __future__ import annotations

import subprocess
import sys

import pytest

import xlog_actors as xa
from xlog_actors.cli import main
from xlog_actors.cli.pipeline import PipelineConfig, run_pipeline


def test_pipeline_is_correct_with_no_explicit_synchronization(driver: xa.Driver) -> None:
    result = run_pipeline(driver, PipelineConfig(batches=12, batch_bytes=1 << 18))
    assert result.ok, result
    assert result.verified == 12 and result.mismatched == [] and result.stale_retries == 0


def test_pipeline_is_correct_with_a_slow_producer(driver: xa.Driver) -> None:
    result = run_pipeline(driver, PipelineConfig(batches=6, batch_bytes=1 << 16, producer_delay_us=30_000))
    assert result.ok, result


@pytest.mark.concurrent_streams
def test_pipeline_fails_when_tracking_is_switched_off(driver: xa.Driver) -> None:
    """The same slow producer without the library actors' tracking: the transformer's kernel
    reads the input before the copy landed, and verification catches it."""
    result = run_pipeline(
        driver, PipelineConfig(batches=6, batch_bytes=1 << 16, producer_delay_us=30_000, track=False)
    )
    assert not result.ok
    assert result.mismatched, result


def test_pipeline_recovers_from_a_rebuild_mid_pipeline(driver: xa.Driver) -> None:
    result = run_pipeline(driver, PipelineConfig(batches=10, batch_bytes=1 << 16, rebuild_at=3, depth=4))
    assert result.ok, result
    assert result.generation == 1
    assert result.stale_retries >= 1, "the batches in flight at the rebuild were redone"


def test_demo_command_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--driver", "host", "--batches", "4", "--batch-mib", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "verification  ok: 4/4" in out and "driver        host" in out and "throughput" in out
    assert main(["demo", "--driver", "host", "--batches", "4", "--batch-mib", "0.25",
                 "--no-tracking", "--slow-producer-us", "30000"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_info_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--driver", "host"]) == 0
    out = capsys.readouterr().out
    for line in ("driver         host", "default stack  async", "devices        1", "versions"):
        assert line in out


def test_module_entry_point_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "xlog_actors", "info", "--driver", "host"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "host-emulated device 0" in proc.stdout


@pytest.mark.parametrize(("batches", "depth"), [(0, 4), (4, 0), (-1, 4), (4, -1)])
def test_run_pipeline_refuses_a_run_that_could_never_finish(driver: xa.Driver, batches: int, depth: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        run_pipeline(driver, PipelineConfig(batches=batches, depth=depth, batch_bytes=1 << 12))
