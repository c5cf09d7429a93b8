"""``xlog-actors chaos``: a short run prints every invariant's row and exits 1 exactly when one
broke; a batch corrupted on its way back breaks its row; each classification rule of the ledger
(a typed error, a timeout, a dead actor, ``GpuRefStale`` on an allocation, a lost message, a hang)
does what it says; a command-line mistake is one line and exit status 2."""

from __future__ import annotations

import pickle
import random
import re
import time
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors.cli import main
from xlog_actors.cli.chaos import load, workers
from xlog_actors.cli.chaos.ledger import INVARIANTS, Ledger, Lost, Watch, call
from xlog_actors.cli.chaos.table import broken_rows, render

pytestmark = pytest.mark.timeout(60)


def _row(out: str, title: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith(title)]
    assert len(lines) == 1, f"no single row {title!r} in:\n{out}"
    return lines[0]


def test_a_short_run_prints_every_invariant_row_and_exits_1_exactly_when_one_broke(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = main(["chaos", "--driver", "host", "--seconds", "3", "--threads", "4", "--fault-every", "0.5"])
    out, err = capsys.readouterr()
    assert "in process for 1.5 s, then isolated for 1.5 s (one after the other)" in err
    header = _row(out, "invariant")
    assert header.split()[1:] == ["in-process", "isolated", "end", "of", "run"]
    for inv in INVARIANTS:
        cells = _row(out, inv.title)[len(inv.title):]
        assert re.search(r"ok \(\d+\)|FAIL \(\d+ of \d+\)", cells), (inv.title, cells)
    for count in ("asks answered", "faults injected", "generation at the end", "restarts counted by the supervisor",
                  "handles sent to workers", "batches verified"):
        assert _row(out, count)
    assert _row(out, "faults injected").split()[-3:-1] != ["-", "-"], "no fault was injected"
    broke = "FAIL" in out
    assert status == (1 if broke else 0)
    assert out.rstrip().splitlines()[-1].startswith("chaos: every invariant held" if not broke else "chaos: ")


def test_a_run_of_the_in_process_device_holds_every_invariant(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["chaos", "--driver", "host", "--devices", "in-process", "--seconds", "2", "--threads", "4",
                   "--workers", "1", "--fault-every", "0.4"])
    out, _ = capsys.readouterr()
    assert status == 0, out
    assert "not run" in _row(out, INVARIANTS[0].title)  # the isolated column
    assert out.rstrip().endswith("chaos: every invariant held")


def test_a_batch_corrupted_on_its_way_back_breaks_its_row_and_exits_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = load.copy_back

    def corrupt(asker: Any, copier: Any, ref: Any) -> bytes:
        data = bytearray(real(asker, copier, ref))
        data[len(data) // 2] ^= 0x40
        return bytes(data)

    monkeypatch.setattr(load, "copy_back", corrupt)
    status = main(["chaos", "--driver", "host", "--devices", "in-process", "--seconds", "1.5", "--threads", "2",
                   "--workers", "0"])
    out, err = capsys.readouterr()
    assert status == 1
    assert re.search(r"FAIL \((\d+) of \1\)\s+not run", _row(out, "every finished batch has the right bytes"))
    assert re.search(r"batch of \d+ floats .*: 1 of \d+ bytes differ, the first at offset \d+", out)
    assert "BROKEN (batches)" in err  # said while it ran, too
    assert out.rstrip().endswith("chaos: 1 invariant(s) broken: every finished batch has the right bytes")


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--seconds", "0"], "--seconds"),
        (["--seconds", "-3"], "--seconds"),
        (["--seconds", "soon"], "--seconds"),
        (["--seconds", "inf"], "--seconds"),
        (["--threads", "0"], "--threads"),
        (["--threads", "65"], "--threads"),
        (["--workers", "-1"], "--workers"),
        (["--workers", "9"], "--workers"),
        (["--fault-every", "0"], "--fault-every"),
        (["--seed", "-1"], "--seed"),
        (["--devices", "gpu"], "--devices"),
        (["--driver", "gpu"], "--driver"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_status_2(
    args: list[str], flag: str, capsys: pytest.CaptureFixture[str],
) -> None:
    try:
        status = main(["chaos", "--driver", "host", *args])
    except SystemExit as exc:
        status = exc.code  # type: ignore[assignment]
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert len(err.splitlines()) == 1 and flag in err and "Traceback" not in err, err


def test_driver_cuda_without_a_gpu_is_one_line_and_exit_status_1(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        xa.open_driver("cuda").close()
    except xa.DeviceUnavailable:
        pass
    else:
        pytest.skip("a GPU is reachable here")
    assert main(["chaos", "--driver", "cuda", "--seconds", "1"]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "no usable GPU" in err


# -- the ledger's rules, one by one -----------------------------------------------------------
def _call(ledger: Ledger, error: BaseException | None, *, allocates: bool = False) -> Any:
    def fn() -> str:
        if error is not None:
            raise error
        return "value"

    return call(ledger, Watch("test"), "Allocate" if allocates else "Fill", 1.0, fn, allocates=allocates)


def test_a_typed_error_is_an_answer_and_the_rest_break_the_invariant() -> None:
    ledger = Ledger("x", echo=False)
    assert _call(ledger, None) == "value"
    with pytest.raises(xa.OutOfMemory):
        _call(ledger, xa.OutOfMemory("full", requested=1, free=0))
    assert ledger.verdict("answered") == (2, 0, [])
    for error in (pykka.Timeout("late"), pykka.ActorDeadError("gone"), ValueError("untyped")):
        with pytest.raises(Lost):
            _call(ledger, error)
    held, broken, messages = ledger.verdict("answered") or (0, 0, [])
    assert (held, broken) == (2, 3)
    assert "no answer within 1 s" in messages[0] and "ActorDeadError" in messages[1] and "untyped" in messages[2]
    ledger.stopping = True  # the device is being stopped on purpose: a dead actor is an answer
    with pytest.raises(Lost):
        _call(ledger, pykka.ActorDeadError("stopped"))
    assert ledger.verdict("answered") == (2, 3, messages)


def test_an_allocate_answered_gpurefstale_breaks_its_own_row() -> None:
    ledger = Ledger("x", echo=False)
    _call(ledger, None, allocates=True)
    with pytest.raises(xa.GpuRefStale):
        _call(ledger, xa.GpuRefStale("context poisoned"), allocates=True)
    with pytest.raises(xa.GpuRefStale):
        _call(ledger, xa.GpuRefStale("context poisoned"))  # on a handle's step it is a fine answer
    assert ledger.verdict("answered") == (3, 0, [])
    held, broken, messages = ledger.verdict("allocate") or (0, 0, [])
    assert (held, broken) == (1, 1) and "Allocate answered GpuRefStale('context poisoned')" in messages[0]


class _Unpicklable:
    def __reduce__(self) -> Any:
        return (_refuse, ())


def _refuse() -> None:
    raise xa.DeviceUnavailable("shared segment 'xlog-refs-1-0' is gone")


def test_a_handle_that_does_not_unpickle_is_a_lost_message() -> None:
    task = ("task", "7", pickle.dumps(_Unpicklable()), b"", 64, 0)
    outcome, detail = workers._serve(task, random.Random(0), None, None)
    assert outcome == "lost" and "DeviceUnavailable: shared segment" in detail
    pool = workers.WorkerPool(0, seed=1)
    ledger = Ledger("isolated", echo=False)
    ledger.ran = True
    pool._pending["7"] = workers._Message(ledger, deadline=float("inf"), keep=None)
    pool._answered("7", outcome, detail)
    assert ledger.verdict("arrived") == (0, 1, [f"a handle sent to a worker did not arrive: {detail}"])
    text = render([ledger], [])
    assert "FAIL (1 of 1)" in _row(text, "every handle sent arrives")
    assert broken_rows([ledger]) == ["every handle sent arrives"]


def test_a_wait_past_its_bound_is_reported_once_as_a_hang() -> None:
    watch = Watch("load-3")
    assert watch.overdue(0.0, 1.0) is None
    watch.begin("CopyToHost", timeout_s=2.0)
    now = time.monotonic()
    assert watch.overdue(now + 2.5, grace_s=1.0) is None
    message = watch.overdue(now + 4.0, grace_s=1.0)
    assert message is not None and message.startswith("load-3: CopyToHost still waiting after")
    assert watch.overdue(now + 5.0, grace_s=1.0) is None  # once per wait
    watch.end()
    assert watch.overdue(now + 9.0, grace_s=1.0) is None
