"""The main job: the demo pipeline and the ``info``/``demo`` commands."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import xlog_actors as xa
from xlog_actors.cli import batches, main, pipeline
from xlog_actors.cli.batches import BatchData
from xlog_actors.cli.graph_pipeline import lanes_for, run_graph_pipeline
from xlog_actors.cli.pipeline import PipelineConfig, run_pipeline
from xlog_actors.cli.raw_pipeline import raw_pipeline
from xlog_actors.kernels import checksum_u32


def test_pipeline_is_correct_with_no_explicit_synchronization(driver: xa.Driver) -> None:
    result = run_pipeline(driver, PipelineConfig(batches=12, batch_bytes=1 << 18))
    assert result.ok, result
    assert result.verified == 12 and result.mismatched == [] and result.stale_retries == 0
    assert result.compared == 2, "the first and the last batch are also compared byte for byte"


@pytest.mark.parametrize("index", [0, 1, 4095, 2**33 + 5])
def test_a_batch_holds_small_integers_by_its_formula_whatever_its_index(index: int) -> None:
    # Element i of batch ``index`` is (7 i + 13 index) mod 4096, exact in float32, however large
    # the index (the uint32 arithmetic wraps past 2**32).
    n = 70_000
    want = ((np.arange(n, dtype=np.int64) * 7 + index * 13) % 4096).astype(np.float32)
    got = batches.make_batch(index, n)
    assert got.dtype == np.float32 and np.array_equal(got, want)


def test_the_inputs_are_built_once_not_per_batch(driver: xa.Driver, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = batches.make_batch

    def counting(index: int, n: int) -> object:
        calls.append(index)
        return real(index, n)

    monkeypatch.setattr(batches, "make_batch", counting)
    counts = []
    for n in (4, 20):
        calls.clear()
        assert run_pipeline(driver, PipelineConfig(batches=n, batch_bytes=1 << 12, depth=3)).ok
        counts.append(len(calls))
    assert counts[0] == counts[1], f"make_batch calls grew with the batches: {counts}"
    assert set(calls) <= set(range(4)), "depth + 1 distinct inputs"


def test_several_batches_are_in_flight_at_once(driver: xa.Driver, monkeypatch: pytest.MonkeyPatch) -> None:
    """The orchestrating thread keeps ``depth`` batches in flight (sent, not yet seen landed)
    instead of one round trip at a time; a slot is never held by two batches at once. Counted as
    each batch starts, before the orchestrator looks for answers: a fast device may have landed
    them all by the end of the step."""
    seen: list[int] = []
    real = pipeline._Run.start

    def start(self: pipeline._Run, index: int, s: int) -> None:
        real(self, index, s)
        holding = [b.slot for b in self.inflight if b.holds_slot]
        assert len(holding) == len(set(holding)), f"a slot held twice: {holding}"
        seen.append(len(self.inflight))

    monkeypatch.setattr(pipeline._Run, "start", start)
    assert run_pipeline(driver, PipelineConfig(batches=24, batch_bytes=1 << 16, depth=4)).ok
    assert max(seen) >= 4
    assert max(seen) <= 8, "at most 2 * depth host sets"


def test_every_batch_is_verified_by_its_device_checksum(driver: xa.Driver, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that computes something else fails every batch, not only the two compared in full."""
    monkeypatch.setattr(pipeline, "ALPHA", 2.0)
    result = run_pipeline(driver, PipelineConfig(batches=6, batch_bytes=1 << 14))
    assert not result.ok
    assert result.mismatched == list(range(6)) and result.verified == 0


def test_a_checksum_collision_cannot_hide_a_wrong_first_or_last_batch(
    driver: xa.Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Output bytes that differ from the host reference while the device checksum matches (as a
    collision would): the byte-for-byte compare of the first and the last batch catches them."""
    nbytes = 1 << 14
    real = batches.landed_output

    def swapped(out: object, nbytes: int) -> object:
        data = bytearray(real(out, nbytes))  # type: ignore[arg-type]  # test double: any buffer
        data[0:4], data[4:8] = data[4:8], data[0:4]  # same words, same sum: a collision
        return bytes(data)

    monkeypatch.setattr(batches, "landed_output", swapped)
    result = run_pipeline(driver, PipelineConfig(batches=5, batch_bytes=nbytes))
    assert result.mismatched == [0, 4]
    assert result.verified == 3
    graph = run_graph_pipeline(driver, PipelineConfig(batches=5, batch_bytes=nbytes))  # the same tally
    assert graph.mismatched == [0, 4]
    assert graph.verified == 3


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
    assert "verification  ok: 4/4" in out and "driver        host" in out
    throughput = next(line for line in out.splitlines() if line.startswith("throughput"))
    assert re.fullmatch(r"throughput +[0-9.e+]+ GB/s \(raw three-stream pipeline: [0-9.e+]+ GB/s, [0-9.]+x; "
                        r"its CPU [0-9.]+ µs a batch\)", throughput), throughput
    assert re.search(r"^cpu +[0-9.]+ µs a batch", out, re.M) and "mode          actors" in out
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


def test_a_failing_stage_ends_the_run_with_its_error(host_driver: xa.HostDriver) -> None:
    """An error other than a stale handle stops the run (no hang), names the stage and the batch,
    and the batches in flight finish before the actors stop."""
    host_driver.inject_fault(0, "error", after_calls=40)
    result = run_pipeline(host_driver, PipelineConfig(batches=40, batch_bytes=1 << 12, timeout_s=60))
    assert not result.ok
    assert result.errors and "injected" in " ".join(result.errors), result.errors
    assert result.verified < 40


def test_the_raw_pipeline_runs_and_verifies(driver: xa.Driver) -> None:
    data = BatchData(5, 1 << 16)
    result = raw_pipeline(driver, data, 12, 4)
    assert result.batches == 12 and result.batch_bytes == 1 << 16 and result.seconds > 0
    assert result.throughput_bytes_s > 0


def test_the_raw_pipeline_catches_a_wrong_result(driver: xa.Driver, monkeypatch: pytest.MonkeyPatch) -> None:
    from xlog_actors.cli import raw_pipeline as raw

    monkeypatch.setattr(raw, "BETA", 1.5)
    with pytest.raises(RuntimeError, match="differs from its host reference"):
        raw_pipeline(driver, BatchData(3, 1 << 12), 6, 2)


@pytest.mark.parametrize(("nbatches", "depth"), [(0, 4), (4, 0)])
def test_the_raw_pipeline_refuses_a_run_that_could_never_finish(driver: xa.Driver, nbatches: int, depth: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        raw_pipeline(driver, BatchData(1, 1 << 12), nbatches, depth)


def test_batch_data_is_built_once_and_checks_its_arguments() -> None:
    data = BatchData(3, 1 << 10)
    assert data.input(4) is data.inputs[1] and data.checksum(5) == data.checksums[2]
    assert data.checksums[0] == checksum_u32(batches.expected(0, 256))
    assert data.matches(3, batches.expected(0, 256)) and not data.matches(1, batches.expected(0, 256))
    for count, nbytes in ((0, 1024), (1, 0), (1, 6)):
        with pytest.raises(ValueError, match="BatchData"):
            BatchData(count, nbytes)


@pytest.mark.parametrize("where", ["warm-up", "copy in"])
def test_a_ring_that_does_not_fit_fails_with_the_allocation_error(
    host_driver: xa.HostDriver, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """8 buffer sets of 2 x 8 MiB on a 64 MiB device: the allocation's error ends the run, named,
    whether the ring is allocated up front (warm-up) or slot by slot as batches start."""
    if where == "copy in":
        monkeypatch.setattr(pipeline._Run, "warm_up", lambda self: None)
    result = run_pipeline(host_driver, PipelineConfig(batches=10, batch_bytes=8 << 20, depth=8, timeout_s=60))
    assert not result.ok and result.verified < 10
    assert len(result.errors) == 1 and result.errors[0].startswith(where), result.errors
    assert "OutOfMemory" in result.errors[0] or "Budget" in result.errors[0], result.errors


def test_a_failed_rebuild_ends_the_run_with_its_error(driver: xa.Driver, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device refuses the rebuild (here: a reason that is not a str): the run stops, says so,
    and the batches already in flight still finish before the actors stop."""
    monkeypatch.setattr(pipeline, "Rebuild", lambda reason: xa.Rebuild(reason=None))  # type: ignore[arg-type]  # a bad field on purpose
    result = run_pipeline(driver, PipelineConfig(batches=8, batch_bytes=1 << 12, rebuild_at=2, timeout_s=60))
    assert not result.ok and result.generation == 0
    assert len(result.errors) == 1 and result.errors[0].startswith("rebuild at batch 2: InvalidRequest"), result.errors


def test_a_run_that_fails_before_it_starts_leaves_no_landing_thread(
    driver: xa.Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure the run does not turn into a result (here in its warm-up) propagates, and the
    landing thread of that run ends with it instead of waiting forever."""
    import threading

    def broken(self: object) -> None:
        raise RuntimeError("warm-up broke")

    monkeypatch.setattr(pipeline._Run, "warm_up", broken)
    before = sum(t.name == "demo-landing" for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="warm-up broke"):
        run_pipeline(driver, PipelineConfig(batches=2, batch_bytes=1 << 12))
    assert sum(t.name == "demo-landing" for t in threading.enumerate()) == before


def test_the_graph_mode_verifies_every_batch_and_survives_a_rebuild(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--driver", "host", "--graph", "--batches", "24", "--batch-mib", "0.0625"]) == 0
    out = capsys.readouterr().out
    assert "verification  ok: 24/24" in out and "mode          graph" in out
    assert main(["demo", "--driver", "host", "--graph", "--batches", "24", "--batch-mib", "0.0625",
                 "--depth", "4", "--rebuild-at", "10"]) == 0
    out = capsys.readouterr().out
    assert "verification  ok: 24/24" in out
    generation = next(line for line in out.splitlines() if line.startswith("generation"))
    redone = r"generation +1 \(([1-9][0-9]*) batch\(es\) redone after stale handles\)"
    assert re.fullmatch(redone, generation), generation


def test_the_graph_mode_refuses_the_actor_pipelines_hazard_flags(capsys: pytest.CaptureFixture[str]) -> None:
    for flags in (["--no-tracking"], ["--slow-producer-us", "100"]):
        assert main(["demo", "--driver", "host", "--graph", *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--graph" in err and "Traceback" not in err


@pytest.mark.gpu
def test_the_graph_mode_on_the_gpu_verifies_every_batch_and_survives_a_rebuild(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--driver", "cuda", "--graph", "--batches", "64", "--batch-mib", "1",
                 "--rebuild-at", "30"]) == 0
    out = capsys.readouterr().out
    assert "verification  ok: 64/64" in out and "generation    1" in out


def test_the_graph_mode_with_lanes_sends_one_batch_a_lane_and_spares_the_rest(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--graph-lanes 3 over a ring of 6 and 10 batches, not a multiple of 3: every replay is of a
    graph of three lanes (four replays: the last one a batch and two spares), every batch is
    verified once, and the spares are not counted."""
    lanes: list[tuple[int, ...]] = []
    real = xa.BatchGraph.replay

    def replay(self: xa.BatchGraph, bind: Any = None) -> Any:
        lanes.append(self.lanes)
        return real(self, bind)

    monkeypatch.setattr(xa.BatchGraph, "replay", replay)
    assert main(["demo", "--driver", "host", "--graph", "--graph-lanes", "3", "--batches", "10",
                 "--batch-mib", "0.0625", "--depth", "6"]) == 0
    captured = capsys.readouterr()
    assert "verification  ok: 10/10 batches" in captured.out and "mode          graph" in captured.out
    assert "graphs of 3 lanes, one replay per 3 batches" in captured.err
    assert lanes == [(3, 3, 3)] * 4, lanes


@pytest.mark.parametrize(("depth", "lanes"), [(4, 3), (5, 5), (8, 1)])
def test_the_graph_mode_verifies_every_batch_whatever_the_lanes(driver: xa.Driver, depth: int, lanes: int) -> None:
    """A ring that the lanes do not divide (its last graph has fewer lanes), as many lanes as
    slots, and one lane: every batch verified, the first and the last byte for byte."""
    result = run_graph_pipeline(driver, PipelineConfig(batches=11, batch_bytes=1 << 12, depth=depth,
                                                       graph_lanes=lanes))
    assert result.ok, result
    assert result.verified == 11 and result.mismatched == [] and result.compared == 2


def test_the_graph_mode_with_lanes_redoes_a_replays_batches_after_a_rebuild(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A rebuild at a batch in the middle lane of a replay of three: every batch verified, and at
    least the three batches of that replay are redone on the new generation."""
    assert main(["demo", "--driver", "host", "--graph", "--graph-lanes", "3", "--batches", "30",
                 "--batch-mib", "0.0625", "--depth", "6", "--rebuild-at", "10"]) == 0
    out = capsys.readouterr().out
    assert "verification  ok: 30/30" in out
    generation = next(line for line in out.splitlines() if line.startswith("generation"))
    found = re.fullmatch(r"generation +1 \(([0-9]+) batch\(es\) redone after stale handles\)", generation)
    assert found is not None and int(found.group(1)) >= 3, generation


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--graph-lanes", "2"], "--graph-lanes"),
        (["--graph", "--graph-lanes", "5", "--depth", "4"], "--graph-lanes 5"),
        (["--graph", "--graph-lanes", "0"], "--graph-lanes"),
    ],
    ids=["without-graph", "more-than-depth", "zero"],
)
def test_bad_graph_lanes_are_a_usage_error(capsys: pytest.CaptureFixture[str], flags: list[str], words: str) -> None:
    """--graph-lanes without --graph, above --depth, or below 1: exit status 2 and one line on
    stderr naming the flag, no traceback, nothing run."""
    try:
        status = main(["demo", "--driver", "host", "--batches", "4", "--batch-mib", "0.0625", *flags])
    except SystemExit as exc:  # argparse's own refusals
        status = exc.code if isinstance(exc.code, int) else 1
    assert status == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and words in captured.err, captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_lanes_for_halves_a_ring_of_small_batches_and_clamps_an_explicit_count() -> None:
    """Automatic: half the ring (at least 1) for batches of at most 1 MiB, 1 above; explicit:
    clamped to 1 .. depth."""
    small, big = 1 << 20, (1 << 20) + 4
    assert lanes_for(PipelineConfig(batch_bytes=small, depth=8)) == 4
    assert lanes_for(PipelineConfig(batch_bytes=small, depth=5)) == 2
    assert lanes_for(PipelineConfig(batch_bytes=small, depth=1)) == 1
    assert lanes_for(PipelineConfig(batch_bytes=big, depth=8)) == 1
    assert lanes_for(PipelineConfig(batch_bytes=big, depth=8, graph_lanes=3)) == 3
    assert lanes_for(PipelineConfig(batch_bytes=small, depth=4, graph_lanes=9)) == 4
    assert lanes_for(PipelineConfig(batch_bytes=small, depth=4, graph_lanes=0)) == 1
