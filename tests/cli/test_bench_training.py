"""The training-loop bench rows off the GPU: skipped with their reason on the host driver and
without torch (or RMM, for the peer row), the size sequence fixed and in range, the program
refusing bad arguments and serving its rounds, and the session that times the halves (turns,
failures, skips and deadlines, with stand-in halves that speak the program's protocol)."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from xlog_actors.cli import main as cli_main
from xlog_actors.cli.bench import SkipRow, training_loop
from xlog_actors.cli.bench.plan import make_plan
from xlog_actors.cli.bench.rows import GROUPS
from xlog_actors.cli.bench.rows_training import TRAINING
from xlog_actors.cli.bench.training_loop import main, step_sizes
from xlog_actors.cli.bench.training_session import run_half, session

NAME = "torch training loop through device"
HIT = "torch allocator bridge, cache hit"
NULL = "torch training loop through the null allocator"
RMM = "torch training loop through RMM"


def test_the_row_is_declared_with_its_target_and_runs_last() -> None:
    assert GROUPS[-1] is TRAINING and TRAINING.names == (HIT, NAME, NULL, RMM)
    assert TRAINING.rows[0].target is None  # informational
    row = TRAINING.rows[1]
    assert row.target is not None and row.target.text == ">= 1.1x"
    assert row.kind == "throughput" and row.host_skip
    for other in TRAINING.rows[2:]:  # the ceiling and the peer: informational
        assert other.target is None and other.kind == "throughput" and other.host_skip
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


@pytest.mark.parametrize("argv", [
    ["bogus", "10"], ["device", "0"], ["torch"], ["null", "10", "-1"], ["rmm", "ten"], ["torch", "10", "0", "9"],
])
def test_the_program_refuses_bad_arguments(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2  # before torch is imported: the refusal needs no torch
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


# -- the program's rounds, with a stand-in for torch ------------------------------------------


class _FakeTensor:
    def fill_(self, value: int) -> None:
        self.value = value


class _FakeTorch:
    """What the loop calls of torch, counting the tensors made."""

    uint8 = "uint8"

    def __init__(self) -> None:
        self.made = 0
        self.synced = 0
        self.cuda = self

    def device(self, kind: str, index: int) -> str:
        return f"{kind}:{index}"

    def empty(self, nbytes: int, dtype: str, device: str) -> _FakeTensor:
        assert dtype == "uint8" and device == "cuda:0" and nbytes >= 4096
        self.made += 1
        return _FakeTensor()

    def synchronize(self) -> None:
        self.synced += 1


def test_the_program_warms_up_says_ready_and_serves_a_round_per_line() -> None:
    fake = _FakeTorch()
    out = io.StringIO()
    training_loop._serve(fake, 7, None, io.StringIO("round\nround\nstop\nround\n"), out)
    lines = out.getvalue().splitlines()
    assert json.loads(lines[0]) == {"ready": True, "cpu": None}
    assert len(lines) == 3 and all(float(x) > 0 for x in lines[1:])  # nothing after the stop
    assert fake.made == 7 * 4 and fake.synced == 4  # two untimed rounds, two timed


def test_the_program_refuses_a_line_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="expected 'round' or 'stop'"):
        training_loop._serve(_FakeTorch(), 3, None, io.StringIO("round\nfaster\n"), io.StringIO())


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="threads are pinned on Linux only")
def test_pinning_binds_only_the_calling_thread() -> None:
    cpu = max(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    seen: list[set[int]] = []

    def pinned() -> None:
        assert training_loop._pin(cpu) == cpu
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=pinned)
    thread.start()
    thread.join()
    assert seen == [{cpu}] and os.sched_getaffinity(0) == before
    assert training_loop._pin(None) is None


# -- the session, with stand-in halves -------------------------------------------------------

_STAND_IN = '''
import json, os, sys, time
half, cpu = sys.argv[1], (sys.argv[3] if len(sys.argv) > 3 else None)
act = os.environ.get("STAND_IN_" + half.upper(), "ok")
if act == "skip":
    print("torch.cuda.is_available() is False", file=sys.stderr)
    sys.exit(3)
if act == "crash":
    print("boom", file=sys.stderr)
    sys.exit(1)
if act == "hang":
    time.sleep(60)
print(json.dumps({"ready": True, "cpu": cpu}), flush=True)
for line in sys.stdin:
    if line.strip() == "stop":
        break
    if act == "hang_round":
        time.sleep(60)
    print(time.monotonic_ns(), flush=True)
print(json.dumps({"done": True, "what": f"{half} on cpu {cpu}"}), flush=True)
if act == "hang_exit":
    print("stuck at exit", file=sys.stderr, flush=True)
    time.sleep(60)
'''


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[subprocess.Popen[bytes]]:
    """Halves run the stand-in script; returns every process the session started."""
    from xlog_actors.cli.bench import training_session

    script = tmp_path / "stand_in.py"
    script.write_text(_STAND_IN)
    monkeypatch.setattr(training_session, "_PROGRAM", (str(script),))
    monkeypatch.setattr(training_session, "_check_available", lambda half: None)
    started: list[subprocess.Popen[bytes]] = []
    real = subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = real(*args, **kwargs)
        started.append(proc)
        return proc

    monkeypatch.setattr(subprocess, "Popen", popen)
    return started


def test_the_halves_take_their_rounds_in_turns_on_one_cpu(stand_in: list[subprocess.Popen[bytes]]) -> None:
    done = session(("a", "b"), 10, 3, processes=2)
    assert len(stand_in) == 4 and all(proc.poll() == 0 for proc in stand_in)
    assert [len(done[h]["ns_per_step"]) for h in ("a", "b")] == [6, 6]
    # the stand-ins print when they ran: the turns are a b a b, then reversed, then again
    order = [h for _, h in sorted((t, h) for h in ("a", "b") for t in done[h]["ns_per_step"])]
    assert order == list("abab" "baba" "abab")
    cpu = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    assert done["a"]["what"] == f"a on cpu {cpu}" and done["b"]["what"] == f"b on cpu {cpu}"


def test_a_half_that_cannot_run_here_skips_the_row(stand_in: list[subprocess.Popen[bytes]],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAND_IN_B", "skip")
    with pytest.raises(SkipRow, match=r"not usable here: torch.cuda.is_available\(\) is False"):
        session(("a", "b"), 10, 2)
    assert stand_in and all(proc.poll() is not None for proc in stand_in)  # none left running


def test_a_half_that_fails_is_the_rows_error(stand_in: list[subprocess.Popen[bytes]],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAND_IN_A", "crash")
    with pytest.raises(RuntimeError, match=r"training loop \(a\) ended, exit status 1: boom"):
        session(("a", "b"), 10, 2)
    assert all(proc.poll() is not None for proc in stand_in)


@pytest.mark.parametrize("act", ["hang", "hang_round"])
def test_a_half_that_stops_answering_is_killed(stand_in: list[subprocess.Popen[bytes]],
                                               monkeypatch: pytest.MonkeyPatch, act: str) -> None:
    monkeypatch.setenv("STAND_IN_B", act)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"training loop \(b\) gave no answer in 1 s"):
        session(("a", "b"), 10, 2, timeout_s=1.0)
    assert time.monotonic() - t0 < 20
    assert all(proc.poll() is not None for proc in stand_in)


def test_a_half_that_does_not_exit_after_its_end_is_killed_with_its_stderr(
        stand_in: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAND_IN_A", "hang_exit")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"training loop \(a\) did not exit in 1 s after its end, exit status -9: "
                                           r"stuck at exit"):
        session(("a", "b"), 10, 1, timeout_s=1.0)
    assert time.monotonic() - t0 < 20
    assert all(proc.poll() is not None for proc in stand_in)
