"""The demo on several devices: one pipeline per device, every batch verified, the aggregate
beside N times one device's raw pipeline; a device that fails leaves the others' batches whole."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors.cli import main
from xlog_actors.cli.multi_demo import resolve_devices, run_multi_demo
from xlog_actors.cli.multi_pipeline import DEFAULT_PLACEMENT, InjectedFault, MultiResult, run_on_devices
from xlog_actors.cli.options import UsageError
from xlog_actors.cli.pipeline import PipelineConfig
from xlog_actors.driver.host import MAX_EMULATED_DEVICES

SMALL = PipelineConfig(batches=6, batch_bytes=64 << 10, depth=2)


def _in_process(count: int, cfg: PipelineConfig, fault: InjectedFault | None = None) -> MultiResult:
    """``run_on_devices`` in-process on a host driver of ``count`` devices of 64 MiB, closed after."""
    driver = xa.HostDriver(device_count=count, memory_per_device=64 << 20)
    try:
        return run_on_devices("host", count, cfg, "in-process", driver, fault=fault)
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()


def test_in_process_runs_every_device_and_times_them_from_one_start() -> None:
    result = _in_process(3, SMALL)
    assert result.ok, result
    assert [run.ordinal for run in result.runs] == [0, 1, 2]
    assert all(run.result is not None and run.result.verified == SMALL.batches for run in result.runs)
    assert result.total_bytes == 3 * SMALL.batches * SMALL.batch_bytes
    starts = [run.started for run in result.runs]
    assert max(starts) - min(starts) < result.seconds + 1.0  # one start gate for all
    assert result.seconds >= max(run.result.seconds for run in result.runs if run.result is not None)
    assert result.throughput_bytes_s > 0


def test_a_device_that_fails_leaves_the_other_devices_batches_whole() -> None:
    """A sticky error on device 1 during the run: device 0 verifies all its batches; device 1
    reports its failure (an in-process device is poisoned for good) and the run is not ok."""
    driver = xa.HostDriver(device_count=2, memory_per_device=64 << 20)
    try:
        driver.inject_fault(1, "sticky", after_calls=60)
        result = run_on_devices("host", 2, PipelineConfig(batches=24, batch_bytes=64 << 10, depth=2), "in-process",
                                driver)
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()
    first, second = result.runs
    assert first.ok and first.result is not None and first.result.verified == 24
    assert not second.ok and not result.ok
    failure = second.error or "; ".join(second.result.errors if second.result is not None else [])
    assert "Poisoned" in failure or "poisoned" in failure, failure
    assert second.error is not None and "cannot be restarted" in second.error


def test_in_process_an_injected_fault_is_reported_as_not_restartable() -> None:
    result = _in_process(2, PipelineConfig(batches=16, batch_bytes=64 << 10, depth=2), InjectedFault(1, 6))
    first, second = result.runs
    assert first.ok and second.restarts == 0 and not second.ok
    assert second.error is not None and "cannot be restarted" in second.error
    assert second.result is not None and second.result.verified <= 6


def test_demo_on_two_devices_says_its_placement_and_verifies_every_batch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--driver", "host", "--devices", "2", "--batches", "4", "--batch-mib", "0.0625"]) == 0
    out, err = capsys.readouterr()
    lines = {line[:14].strip(): line[14:] for line in out.splitlines()}
    assert DEFAULT_PLACEMENT == "isolated"
    assert lines["placement"].startswith("isolated: one worker process per device")
    assert lines["devices"].startswith("2 ")
    assert "4/4 verified" in lines["device 0"] and "4/4 verified" in lines["device 1"]
    assert "GB/s" in lines["aggregate"]
    assert "aggregate / that" in lines["raw x 2"]
    assert lines["verification"].startswith("ok: 8/8 batches")
    assert "on 2 devices at once (isolated)" in err


def test_one_device_is_the_single_device_demo_unchanged() -> None:
    args = argparse.Namespace(devices=None, placement=None)
    assert run_multi_demo(args) is None
    assert run_multi_demo(argparse.Namespace(devices=1, placement=None)) is None
    with pytest.raises(UsageError, match="--placement"):
        run_multi_demo(argparse.Namespace(devices=1, placement="isolated"))


def test_resolve_devices() -> None:
    assert resolve_devices("all", "cuda", 4) == 4
    assert resolve_devices(2, "cuda", 4) == 2
    with pytest.raises(UsageError, match="--devices 5: the cuda driver has 4 device"):
        resolve_devices(5, "cuda", 4)
    assert resolve_devices(3, "host", 1) == 3  # emulated
    assert resolve_devices("all", "host", 1) == 1
    with pytest.raises(UsageError, match=f"1 to {MAX_EMULATED_DEVICES}"):
        resolve_devices(MAX_EMULATED_DEVICES + 1, "host", 1)


def test_run_on_devices_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="count"):
        run_on_devices("host", 0, SMALL)
    with pytest.raises(ValueError, match="kind"):
        run_on_devices("gpu", 2, SMALL)
    with pytest.raises(ValueError, match="placement"):
        run_on_devices("host", 2, SMALL, "elsewhere")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a driver of 2 devices"):
        run_on_devices("host", 2, SMALL, "in-process", None)


def _multi_rows(count: int, wanted: Callable[[str], bool]) -> list[Any]:
    """The results of the rows of several devices that ``wanted`` picks, run in order on a host
    driver of ``count`` emulated devices (its quick plan)."""
    from xlog_actors.cli.bench.harness import Context, run_group
    from xlog_actors.cli.bench.plan import make_plan
    from xlog_actors.cli.bench.rows_multi import MULTI

    driver = xa.HostDriver(device_count=count)
    ctx = Context(driver, make_plan("host", quick=True), wanted, lambda line: None)
    try:
        run_group(MULTI, ctx)
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()
    return list(ctx.results)


def test_the_bench_rows_of_several_devices_run_on_two_and_skip_on_one() -> None:
    from xlog_actors.cli.bench.result import RowResult, Skipped

    for count in (1, 2):
        # On two devices only the 1 MiB rows run here (a 256 MiB copy through shared memory takes
        # seconds on the host; the copy itself is tested in tests/actors/test_cross_process_copy.py).
        wanted = ("1 MiB", "peer") if count == 1 else ("1 MiB",)
        results = _multi_rows(count, lambda name, wanted=wanted: any(w in name for w in wanted))
        by_name = {r.name: r for r in results}
        demo = by_name["demo on N GPUs / N x one GPU 1 MiB"]
        graph = by_name["demo graph on N GPUs / N x one GPU 1 MiB"]
        raw = by_name["raw pipeline on N GPUs at once / N x one GPU 1 MiB"]
        if count == 1:
            peer = by_name["cross-process peer copy 256 MiB"]
            for row in (demo, graph, raw, peer):
                assert isinstance(row, Skipped) and "needs 2 devices or more" in row.reason, row
            assert isinstance(raw, Skipped) and raw.reason == "needs 2 devices or more; the host driver has 1"
        else:
            # The raw row runs first: the demo rows' notes read it.
            assert [r.name for r in results] == [raw.name, demo.name, graph.name]
            assert isinstance(raw, RowResult) and raw.median > 0 and raw.ratio > 0
            assert raw.target is None and raw.informational and raw.kind == "rate"
            for row in (demo, graph):
                assert isinstance(row, RowResult) and row.median > 0 and row.ratio > 0
                ratio = row.median / raw.median
                assert f"ours / the raw pipeline on N GPUs at once (`{raw.name}`, this run): {ratio:.3f}x" in row.note
            assert "in graph mode" in graph.measures and "in actor mode" in demo.measures


def test_the_demo_row_says_when_no_raw_row_ran_before_it() -> None:
    from xlog_actors.cli.bench.result import RowResult

    (demo,) = _multi_rows(2, lambda name: name == "demo on N GPUs / N x one GPU 1 MiB")
    assert isinstance(demo, RowResult)
    assert "did not run before it, so no ratio to the raw pipeline at once" in demo.note


def test_a_sticky_error_on_one_device_restarts_its_worker_and_every_batch_is_verified() -> None:
    """Isolated: device 1 of 2 meets a sticky error at its batch 10. Its worker process ends, a
    new one runs the batches it had not verified; device 0 runs on untouched; every batch of both
    is verified, each exactly once (the first worker's count plus the second's is the total)."""
    cfg = PipelineConfig(batches=24, batch_bytes=64 << 10, depth=2)
    result = run_on_devices("host", 2, cfg, fault=InjectedFault(1, 10))
    first, second = result.runs
    assert result.ok, [(r.ordinal, r.error, r.faults, r.result and r.result.errors) for r in result.runs]
    assert first.restarts == 0 and first.result is not None and first.result.verified == 24
    assert second.restarts == 1 and second.result is not None and second.result.verified == 24
    assert len(second.faults) == 1 and "ContextPoisoned" in second.faults[0], second.faults
    by_worker = second.result.extra["verified_by_worker"]
    assert len(by_worker) == 2 and sum(by_worker) == 24 and 0 < by_worker[0] <= 10, by_worker
    assert result.total_bytes == 2 * 24 * cfg.batch_bytes


def test_a_device_that_faults_past_its_restarts_is_reported_failed_and_the_others_complete() -> None:
    cfg = PipelineConfig(batches=24, batch_bytes=64 << 10, depth=2)
    result = run_on_devices("host", 2, cfg, max_restarts=1, fault=InjectedFault(1, 6, lives=2))
    first, second = result.runs
    assert first.ok and first.result is not None and first.result.verified == 24
    assert not second.ok and not result.ok and second.restarts == 1 and len(second.faults) == 1
    assert second.result is not None and 0 < second.result.verified < 24
    assert any("ContextPoisoned" in e for e in second.result.errors), second.result.errors
    assert sum(second.result.extra["verified_by_worker"]) == second.result.verified


def test_run_on_devices_refuses_a_fault_outside_the_run() -> None:
    with pytest.raises(ValueError, match="fault"):
        run_on_devices("host", 2, SMALL, fault=InjectedFault(2, 0))
    with pytest.raises(ValueError, match="fault"):
        run_on_devices("host", 2, SMALL, fault=InjectedFault(0, SMALL.batches))
    with pytest.raises(ValueError, match="max_restarts"):
        run_on_devices("host", 2, SMALL, max_restarts=-1)


def test_demo_fault_flags_restart_the_faulted_device(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--driver", "host", "--devices", "2", "--batches", "12", "--batch-mib", "0.0625", "--depth", "2",
            "--fault-device", "0", "--fault-at", "5"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "planted on device 0 at its batch 5" in err
    lines = {line[:14].strip(): line[14:] for line in out.splitlines()}
    assert "12/12 verified" in lines["device 0"] and "restarts 1" in lines["device 0"]
    assert "12/12 verified" in lines["device 1"] and "restarts 0" in lines["device 1"]
    assert "worker process 0 of device 0 ended" in lines["restart 1"]
    assert lines["verification"].startswith("ok: 24/24 batches")


def test_the_graph_mode_runs_on_every_device_at_once() -> None:
    """``cfg.graph``: each device runs the graph mode's pipeline (lanes, prepared bindings), timed
    from one start gate, every batch verified on every device."""
    from dataclasses import replace

    cfg = replace(SMALL, batches=7, depth=4, graph=True)
    result = _in_process(2, cfg)
    assert result.ok, result
    assert all(run.result is not None and run.result.verified == 7 for run in result.runs)
    assert all(run.result is not None and run.result.extra["mode"] == "graph" for run in result.runs)
    with pytest.raises(ValueError, match="graph mode plants none"):
        run_on_devices("host", 2, cfg, fault=InjectedFault(0, 1))


def test_demo_graph_on_two_devices(capsys: pytest.CaptureFixture[str]) -> None:
    """``demo --graph --devices 2`` runs and verifies every batch of both devices; ``--graph``
    with the planted fault is a usage error (one line, exit 2)."""
    argv = ["demo", "--driver", "host", "--devices", "2", "--placement", "in-process", "--graph", "--batches", "6",
            "--batch-mib", "0.0625", "--depth", "4"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "(graph mode) on 2 devices at once (in-process)" in err
    assert "ok: 12/12 batches" in out
    fault = ["--fault-device", "0", "--fault-at", "1"]
    assert main(["demo", "--driver", "host", "--devices", "2", "--graph", *fault]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "--fault-device" in err and "Traceback" not in err
