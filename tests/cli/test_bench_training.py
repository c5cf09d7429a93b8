"""The training-loop bench rows off the GPU: skipped with their reason on the host driver and
without torch (or RMM, for the peer row), the size sequence fixed and in range, the program
refusing bad arguments."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from xlog_actors.cli import main as cli_main
from xlog_actors.cli.bench import SkipRow
from xlog_actors.cli.bench.plan import make_plan
from xlog_actors.cli.bench.rows import GROUPS
from xlog_actors.cli.bench.rows_training import TRAINING, run_half
from xlog_actors.cli.bench.training_loop import main, step_sizes

NAME = "torch training loop through device"
HIT = "torch allocator bridge, cache hit"
RMM = "torch training loop through RMM"


def test_the_row_is_declared_with_its_target_and_runs_last() -> None:
    assert GROUPS[-1] is TRAINING and TRAINING.names == (HIT, NAME, RMM)
    assert TRAINING.rows[0].target is None  # informational
    row = TRAINING.rows[1]
    assert row.target is not None and row.target.text == ">= 1.1x"
    assert row.kind == "throughput" and row.host_skip
    peer = TRAINING.rows[2]
    assert peer.target is None and peer.kind == "throughput" and peer.host_skip  # a peer: informational
    assert make_plan("cuda", quick=False).train_steps == 10_000
    assert make_plan("cuda", quick=True).train_steps < 10_000


def test_the_cache_hit_row_runs_on_the_host_and_is_served_by_the_cache(tmp_path: Path) -> None:
    path = tmp_path / "hit.json"
    assert cli_main(["bench", "--driver", "host", "--quick", "--only", HIT, "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["errors"] == [] and [r["name"] for r in doc["rows"]] == [HIT]
    row = doc["rows"][0]
    # No speed claim here (that is the bench's job, and a loaded machine moves it): the row's check
    # (every timed pair after the first served by the cache) ran, or ``errors`` would name it.
    assert row["ratio"] > 0 and row["samples"] > 0, row


def test_the_sizes_are_fixed_and_span_4_kib_to_64_mib() -> None:
    sizes = step_sizes()
    assert sizes == step_sizes()
    assert min(sizes) >= 4 << 10 and max(sizes) <= 64 << 20
    assert min(sizes) < 64 << 10 and max(sizes) > 16 << 20  # both ends are drawn
    assert all(n % 512 == 0 for n in sizes)


def test_the_program_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bogus", "10", "1"]) == 2
    assert main(["device", "0", "1"]) == 2
    assert main(["rmm", "10", "0"]) == 2
    assert "usage" in capsys.readouterr().err


def test_without_torch_the_row_is_skipped_with_the_reason() -> None:
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed here: the row runs (on a GPU) instead")
    with pytest.raises(SkipRow, match="torch is not installed"):
        run_half("device", 10, 1)


def test_without_rmm_the_peer_row_is_skipped_with_the_reason() -> None:
    if importlib.util.find_spec("rmm") is not None:
        pytest.skip("RMM is installed here: the peer row runs (on a GPU) instead")
    with pytest.raises(SkipRow, match="RMM is not installed"):
        run_half("rmm", 10, 1)


def test_on_the_host_driver_the_peer_row_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "rmm.json"
    assert cli_main(["bench", "--driver", "host", "--quick", "--only", RMM, "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["errors"] == [] and doc["rows"] == [], doc
    assert any(RMM in str(skip) and "CUDA driver only" in str(skip) for skip in doc["skipped"]), doc["skipped"]


@pytest.mark.parametrize("rounds", [1, 4, 5])
def test_the_halves_run_in_abba_order_with_the_rounds_split(monkeypatch: pytest.MonkeyPatch, rounds: int) -> None:
    from xlog_actors.cli.bench import rows_training

    calls: list[tuple[str, int]] = []

    def fake_half(half: str, steps: int, n: int, timeout_s: float = 600.0) -> dict[str, object]:
        calls.append((half, n))
        return {"what": half, "ns_per_step": [float(len(calls))] * n}

    monkeypatch.setattr(rows_training, "run_half", fake_half)
    ours, ref = rows_training._interleaved("device", "torch", 100, rounds)
    first, second = (rounds + 1) // 2, rounds // 2
    expected = [("device", first), ("torch", first)] + ([("torch", second), ("device", second)] if second else [])
    assert calls == expected
    assert len(ours["ns_per_step"]) == rounds and len(ref["ns_per_step"]) == rounds
    # each half's samples come from its own processes, in their order
    assert ours["ns_per_step"] == [1.0] * first + [4.0] * second
    assert ref["ns_per_step"] == [2.0] * first + [3.0] * second
