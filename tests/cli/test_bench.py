"""``xlog-actors bench``: the command runs end to end on the host driver and writes well-formed
JSON. Benchmarks are not tests: nothing here asserts a target or a timing."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import xlog_actors as xa
from xlog_actors.actors import Fill
from xlog_actors.cli import main
from xlog_actors.cli.bench import (
    GROUPS,
    Group,
    Row,
    RowResult,
    SkipRow,
    Target,
    collect,
    percentile,
    render_table,
    row_names,
)
from xlog_actors.cli.bench.harness import Op, given

ROW_KEYS = {"name", "median", "p99", "reference", "ratio", "target", "direction", "unit"}


def _positive_finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def quick_doc(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    assert main(["bench", "--driver", "host", "--quick", "--json", str(path)]) == 0
    return json.loads(path.read_text(encoding="utf-8"))


def test_quick_host_json_header(quick_doc: dict) -> None:
    assert quick_doc["driver"] == "host"
    assert isinstance(quick_doc["device"], str) and quick_doc["device"]
    assert quick_doc["devices"] == [quick_doc["device"]]  # the host bench's driver has one device
    assert isinstance(quick_doc["versions"], dict) and "python" in quick_doc["versions"]
    assert isinstance(quick_doc["date"], str) and quick_doc["date"][:2] == "20"
    assert quick_doc["quick"] is True
    assert quick_doc["errors"] == []


def test_quick_host_json_rows(quick_doc: dict) -> None:
    rows = quick_doc["rows"]
    assert rows, "no rows measured"
    for row in rows:
        assert set(row) >= ROW_KEYS, f"{row.get('name')}: missing {ROW_KEYS - set(row)}"
        for key in ("median", "p99", "ratio"):
            assert _positive_finite(row[key]), f"{row['name']}: {key} = {row[key]!r}"
        ref = row["reference"]
        assert isinstance(ref["name"], str) and ref["name"]
        assert _positive_finite(ref["median"]) and _positive_finite(ref["p99"])
        assert row["direction"] in ("lower_is_better", "higher_is_better")
        assert row["unit"] in ("us", "GB/s", "ops/s")
        assert (row["unit"] == "us") == (row["direction"] == "lower_is_better")
        if row["target"] is None:
            assert row["pass"] is None and row["informational"]
        else:
            assert set(row["target"]) >= {"metric", "op", "value", "text"}
            assert isinstance(row["pass"], bool)


def test_quick_host_covers_every_row(quick_doc: dict) -> None:
    """Every row is either measured or skipped with a reason (the peers' allocators and the
    driver-layer rows are CUDA-only)."""
    seen = {r["name"] for r in quick_doc["rows"]} | {s["name"] for s in quick_doc["skipped"]}
    assert seen == set(row_names())
    assert all(s["reason"] for s in quick_doc["skipped"])
    targeted = {r["name"] for r in quick_doc["rows"] if r["target"] is not None}
    assert len(targeted) == 26  # the twenty-six rows with a target that run on the host


def test_quick_host_measures_the_history_row(quick_doc: dict) -> None:
    """The memory history's cost: beside the same resource with the history off."""
    row = {r["name"]: r for r in quick_doc["rows"]}["AsyncCudaResource alloc+free, history on"]
    assert row["target"]["text"] == "<= 2x"
    assert row["reference"]["name"] == "the same with the history off"
    assert row["unit"] == "us"


def test_quick_host_runs_the_concurrency_rows(quick_doc: dict) -> None:
    rows = {r["name"]: r for r in quick_doc["rows"]}
    for name, ours in (("DeviceClient 8 threads / 1 thread", 8), ("Allocate 16 workers / 1 worker", 16)):
        row = rows[name]
        assert row["unit"] == "ops/s" and row["direction"] == "higher_is_better"
        assert row["concurrency"] == {"ours": ours, "reference": 1}
        assert row["target"]["text"] == ">= 1x" and isinstance(row["pass"], bool)
        # a sample of ours runs every thread's (actor's) share: ``ours`` times the ops of one
        assert row["ops_per_sample"] == row["reference"]["ops_per_sample"]
        assert row["ops_per_sample"] % ours == 0
        # the ratio is of the aggregate throughputs
        assert row["ratio"] == pytest.approx(row["median"] / row["reference"]["median"])
    cached = rows["DeviceClient through the cache 8 threads / 1 thread"]
    assert cached["concurrency"] == {"ours": 8, "reference": 1} and cached["target"]["text"] == ">= 1x"
    # the other rows carry the new key empty: readers of older runs see nothing else change
    assert all(r["concurrency"] is None for r in quick_doc["rows"] if r["unit"] != "ops/s")


def test_quick_host_measures_the_library_message_round_trip(quick_doc: dict) -> None:
    """One small library message asked of a CopyActor, beside the bare pykka ask it must beat."""
    row = {r["name"]: r for r in quick_doc["rows"]}["CopyActor Fill round trip"]
    assert row["reference"]["name"] == "bare pykka ask round trip to a trivial actor"
    assert row["target"]["text"] == "<= 0.25x" and row["unit"] == "us"
    assert "served in the asker's thread" in row["note"]
    assert _positive_finite(row["median"]) and _positive_finite(row["reference"]["median"])


def _fill_row_only() -> Group:
    (actors,) = [group for group in GROUPS if "CopyActor Fill round trip" in group.names]
    (row,) = [row for row in actors.rows if row.name == "CopyActor Fill round trip"]
    return Group(actors.title, (row,), base=actors.base)


def test_the_library_message_row_is_served_in_the_askers_thread(
    host_driver_for_bench: xa.Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the row's note claims: once the setup's first Fill has started the actor, every timed
    ``copy.ask(Fill(ref, 7))`` runs its handler in the asking thread, not the actor's."""
    from xlog_actors.actors.copy_actor import CopyActor

    threads: list[int] = []
    fill = CopyActor._fill

    def spy(self: CopyActor, msg: Fill) -> None:
        if msg.byte == 7:
            threads.append(threading.get_ident())
        fill(self, msg)

    monkeypatch.setattr(CopyActor, "_fill", spy)
    doc = collect(host_driver_for_bench, quick=True, groups=[_fill_row_only()])
    assert doc["errors"] == [] and [r["name"] for r in doc["rows"]] == ["CopyActor Fill round trip"]
    assert len(threads) >= 10 and set(threads) == {threading.get_ident()}


def test_the_library_message_row_checks_that_its_fills_ran(
    host_driver_for_bench: xa.Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    from xlog_actors.actors.copy_actor import CopyActor

    fill = CopyActor._fill

    def lost(self: CopyActor, msg: Fill) -> None:
        if msg.byte != 7:  # the setup's fill runs; the timed ones are answered but do nothing
            fill(self, msg)

    monkeypatch.setattr(CopyActor, "_fill", lost)
    doc = collect(host_driver_for_bench, quick=True, groups=[_fill_row_only()])
    assert doc["rows"] == []
    assert "not the bytes the timed asks filled" in doc["errors"][0]["error"]


def test_allocation_and_concurrency_rows_keep_their_targets() -> None:
    """The targets docs/performance.md gives these rows: changing one is changing the goal, not a fix."""
    targets = {row.name: row.target.text for group in GROUPS for row in group.rows if row.target is not None}
    assert {name: targets[name] for name in (
        "AsyncCudaResource alloc+free", "cross-stream read prepare+finish", "DeviceClient allocate+free",
        "DeviceActor AllocateMany(64)", "DeviceActor Allocate", "DirectCudaResource alloc+free", "GpuRef.access",
        "DeviceClient 8 threads / 1 thread", "Allocate 16 workers / 1 worker",
    )} == {
        "AsyncCudaResource alloc+free": "<= 1x", "cross-stream read prepare+finish": "<= 1.2x",
        "DeviceClient allocate+free": "<= 1.5x", "DeviceActor AllocateMany(64)": "<= 1.5x",
        "DeviceActor Allocate": "<= 1.1x", "DirectCudaResource alloc+free": "<= 1.02x",
        "GpuRef.access": "median <= 0.04", "DeviceClient 8 threads / 1 thread": ">= 1x",
        "Allocate 16 workers / 1 worker": ">= 1x",
    }


def test_a_throughput_row_reports_aggregate_operations_per_second() -> None:
    row = RowResult("t", "", "r", ours=[500.0, 500.0], ref=[1000.0, 1000.0], ops_per_sample=8, kind="throughput",
                    target=Target("ratio", ">=", 1.0), ref_ops_per_sample=8, concurrency=(8, 1))
    assert row.unit == "ops/s" and row.direction == "higher_is_better"
    assert row.median == pytest.approx(2e6)  # 500 ns per op, all threads together
    assert row.ratio == pytest.approx(2.0) and row.passed is True
    doc = row.to_json()
    assert doc["concurrency"] == {"ours": 8, "reference": 1}
    assert doc["reference"]["median"] == pytest.approx(1e6)
    assert "operations per second" in doc["ratio_definition"]
    slower = RowResult("s", "", "r", ours=[2000.0], ref=[1000.0], ops_per_sample=8, kind="throughput",
                       target=Target("ratio", ">=", 1.0))
    assert slower.ratio == pytest.approx(0.5) and slower.passed is False
    assert RowResult("x", "", "r", ours=[1.0], ref=[1.0], ops_per_sample=1).to_json()["concurrency"] is None
    table = render_table({
        "driver": "host", "device": "d", "date": "2026-11-23", "quick": True, "versions": {}, "seconds": 0.1,
        "rows": [doc], "skipped": [], "errors": [],
    })
    assert "2,000,000 ops/s" in table and "2.000x ↑" in table


def test_only_selects_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "only.json"
    assert main(["bench", "--driver", "host", "--quick", "--only", "GpuRef.access", "--json", str(path)]) == 0
    doc = json.loads(path.read_text(encoding="utf-8"))
    assert [r["name"] for r in doc["rows"]] == ["GpuRef.access"]
    assert "GpuRef.access" in capsys.readouterr().out


def test_only_unknown_row_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--driver", "host", "--quick", "--only", "no such row"]) == 2
    assert "matches no row" in capsys.readouterr().err


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([2.0, 1.0], 99) == 2.0


def test_ratio_directions() -> None:
    time_row = RowResult("t", "", "r", ours=[2000.0, 2000.0], ref=[1000.0, 1000.0], ops_per_sample=1,
                         target=Target("ratio", "<=", 1.5))
    assert time_row.ratio == pytest.approx(2.0)
    assert time_row.median == pytest.approx(2.0)  # µs
    assert time_row.passed is False
    rate_row = RowResult("b", "", "r", ours=[2e6], ref=[1e6], ops_per_sample=1, kind="rate",
                         bytes_per_op=1 << 30, target=Target("ratio", ">=", 0.95))
    assert rate_row.ratio == pytest.approx(0.5)  # half the reference's bandwidth
    assert rate_row.median == pytest.approx((1 << 30) / 2e6)  # GB/s
    assert rate_row.passed is False
    absolute = RowResult("a", "", "r", ours=[100.0], ref=[50.0], ops_per_sample=1, target=Target("median", "<", 0.5))
    assert absolute.passed is True


def test_a_row_declared_in_a_few_lines_runs_through_the_harness(host_driver_for_bench: xa.Driver) -> None:
    """A new row is data: a name, what it measures, a setup, an operation, a twin, a plan entry
    and a target. The harness times it beside its twin and builds its figures."""

    def op(f: object) -> Op:
        return lambda n: sum(range(20 * n))

    def twin(f: object) -> Op:
        return lambda n: sum(range(n))

    row = Row("sum of 20n", "sum(range(20 n))", given, op, twin, lambda p: p.alloc,
              reference="sum(range(n))", target=Target("ratio", ">=", 1.0))
    doc = collect(host_driver_for_bench, quick=True, groups=[Group("test rows", (row,))])
    assert doc["errors"] == []
    (got,) = doc["rows"]
    assert got["name"] == "sum of 20n" and got["reference"]["name"] == "sum(range(n))"
    assert _positive_finite(got["ratio"]) and got["ratio"] > 2  # twenty times the work, far above noise
    assert got["pass"] is True and got["informational"] is False
    assert got["samples"] >= 5 and got["ops_per_sample"] == 10


def test_a_row_that_cannot_run_here_is_skipped_with_its_reason(host_driver_for_bench: xa.Driver) -> None:
    def unusable(f: object) -> Op:
        raise SkipRow("no such peer")

    rows = (
        Row("cuda only", "x", given, unusable, unusable, lambda p: p.alloc, host_skip="CUDA driver only"),
        Row("absent peer", "x", given, unusable, unusable, lambda p: p.alloc),
    )
    doc = collect(host_driver_for_bench, quick=True, groups=[Group("test rows", rows)])
    assert doc["rows"] == [] and doc["errors"] == []
    assert doc["skipped"] == [{"name": "cuda only", "reason": "CUDA driver only"},
                              {"name": "absent peer", "reason": "no such peer"}]


def test_a_failing_row_is_reported_as_an_error_of_its_group(host_driver_for_bench: xa.Driver) -> None:
    def broken(f: object) -> Op:
        raise RuntimeError("the device holds other bytes")

    row = Row("broken", "x", given, broken, broken, lambda p: p.alloc)
    doc = collect(host_driver_for_bench, quick=True, groups=[Group("test rows", (row,))])
    assert doc["rows"] == []
    assert [e["group"] for e in doc["errors"]] == ["test rows"]
    assert "RuntimeError: the device holds other bytes" in doc["errors"][0]["error"]


@pytest.fixture
def host_driver_for_bench() -> Iterator[xa.Driver]:
    driver = xa.HostDriver()
    try:
        yield driver
    finally:
        driver.close()


@pytest.mark.parametrize("what", ["profile", "decompose"])
def test_profile_and_decompose_run_on_the_host(what: str) -> None:
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "xlog_actors.cli.bench", what, "--driver", "host", "--ops", "100"],
        capture_output=True, text=True, timeout=120, check=False, env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert proc.returncode == 0, proc.stderr
    marker = "=== GpuRef.access" if what == "profile" else "GpuRef.access()"
    assert marker in proc.stdout


def test_quick_host_measures_the_cross_process_read(quick_doc: dict) -> None:
    """A consumer process reads the owner's shared block; its check compared the bytes."""
    row = {r["name"]: r for r in quick_doc["rows"]}["cross-process read"]
    assert row["unit"] == "GB/s" and row["target"]["text"] == ">= 0.95x"
    assert _positive_finite(row["median"]) and _positive_finite(row["reference"]["median"])
    assert quick_doc["errors"] == []


def test_quick_host_measures_the_cache_rows_in_one_measurement(quick_doc: dict) -> None:
    """The block cache's rows share one round-robin measurement: one twin, one set of samples."""
    rows = {r["name"]: r for r in quick_doc["rows"]}
    names = ("AsyncCudaResource through the cache alloc+free", "DeviceClient through the cache allocate+free",
             "AsyncCudaResource alloc+free, same measurement")
    twins = {(rows[name]["reference"]["median"], rows[name]["reference"]["samples"]) for name in names}
    assert len(twins) == 1
    assert rows[names[0]]["target"]["text"] == "<= 0.15x" and rows[names[1]]["target"]["text"] == "<= 0.2x"


def test_peer_rows_and_ours_share_one_measurement_of_the_twin() -> None:
    """Every row of the peers' group reads the group's one round-robin measurement."""
    (peers,) = [group for group in GROUPS if "PyTorch caching empty+del" in group.names]
    assert {row.setup for row in peers.rows} == {peers.rows[0].setup}
    assert all(row.measure is not None for row in peers.rows)
    assert "ours beside the peers: DeviceClient through the cache" in peers.names


def test_the_text_header_names_a_machine_of_several_devices() -> None:
    from xlog_actors.cli.bench.report import _more_devices

    assert _more_devices({"devices": ["NVIDIA H100", "NVIDIA H100"]}) == " (of 2 devices)"
    assert _more_devices({"devices": ["NVIDIA H100"]}) == ""
    assert _more_devices({}) == ""  # a document written before the field existed
