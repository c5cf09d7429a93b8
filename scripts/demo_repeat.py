"""Run the demo pipeline several times in one process, beside the raw pipeline, with the garbage
collector on and off: shows whether a run's speed depends on what ran before it in the process.

    python scripts/demo_repeat.py [cuda|host] [runs] [MiB per batch] [batches] [noraw]

Each run also prints its longest waits between two answers of the orchestrator's queue.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from typing import Any

from xlog_actors.cli import pipeline
from xlog_actors.cli.batches import BatchData
from xlog_actors.cli.pipeline import PipelineConfig, run_pipeline
from xlog_actors.cli.raw_pipeline import raw_pipeline
from xlog_actors.driver import open_driver

_answers: list[tuple[float, int, int]] = []
_on_answer = pipeline._Run.on_answer


def _logged(self: Any, answer: Any) -> None:
    _answers.append((time.perf_counter(), answer.key.index, answer.key.stage))
    _on_answer(self, answer)


def _gaps() -> str:
    """The run's longest waits between two answers, with the batch and stage answered after each."""
    if len(_answers) < 2:
        return ""
    t0 = _answers[0][0]
    gaps = sorted(((b[0] - a[0], b[0] - t0, b[1], b[2]) for a, b in zip(_answers, _answers[1:], strict=False)),
                  reverse=True)[:4]
    total = _answers[-1][0] - t0
    return f"  answers span {total * 1e3:.1f} ms; longest gaps: " + ", ".join(
        f"{g * 1e3:.1f} ms at +{at * 1e3:.1f} (batch {i} stage {st})" for g, at, i, st in gaps)


_frees: list[tuple[float, float, str]] = []


def _watch_frees(driver: Any) -> None:
    """Log every ``free_pinned`` of ``driver``: when, how long, on which thread."""
    real = driver.free_pinned

    def free_pinned(ordinal: int, ptr: int) -> None:
        t = time.perf_counter()
        real(ordinal, ptr)
        _frees.append((t, time.perf_counter() - t, threading.current_thread().name))

    driver.free_pinned = free_pinned


def _frees_in(t0: float, t1: float) -> str:
    inside = [f for f in _frees if t0 <= f[0] <= t1]
    if not inside:
        return "  no pinned frees during the run"
    return (f"  {len(inside)} pinned frees during the run, {sum(f[1] for f in inside) * 1e3:.1f} ms in all, on "
            + ", ".join(sorted({f[2] for f in inside})))


_marks: list[tuple[float, str]] = []


def _mark_calls(owner: Any, name: str, label: str) -> None:
    """Record when each call of ``owner.name`` begins and ends (the first few of each run)."""
    real = getattr(owner, name)

    def marked(*args: Any, **kwargs: Any) -> Any:
        if len(_marks) < 60:
            _marks.append((time.perf_counter(), f"{label}>"))
        try:
            return real(*args, **kwargs)
        finally:
            if len(_marks) < 60:
                _marks.append((time.perf_counter(), f"<{label}"))

    setattr(owner, name, marked)


def _timeline(t0: float) -> str:
    """The run's first marks, in ms after the clock started."""
    return "  first calls: " + " ".join(f"{label}@{(t - t0) * 1e3:.1f}" for t, label in _marks[:24] if t >= t0)


def main() -> None:
    kind = sys.argv[1] if len(sys.argv) > 1 else "host"
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    mib = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    batches = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    no_raw = len(sys.argv) > 5 and sys.argv[5] == "noraw"
    driver = open_driver(kind)
    pipeline._Run.on_answer = _logged  # type: ignore[method-assign]
    _watch_frees(driver)
    from xlog_actors.actors.copy_actor import CopyActor
    from xlog_actors.actors.library_actor import LibraryActor
    _mark_calls(pipeline._Run, "start", "start")
    _mark_calls(pipeline._Run, "step", "step")
    _mark_calls(LibraryActor, "on_receive", "recv")
    _mark_calls(CopyActor, "_to_device", "h2d")
    _mark_calls(driver, "copy_to_device", "drv.h2d")
    real_drive = pipeline._drive

    def drive(*args: Any) -> float:
        _marks.clear()
        _marks.append((time.perf_counter(), "t0"))
        return real_drive(*args)

    pipeline._drive = drive
    cfg = PipelineConfig(batches=batches, batch_bytes=mib << 20, depth=4)
    data = BatchData(cfg.depth + 1, cfg.batch_bytes)
    gbytes = batches * cfg.batch_bytes / 1e9
    for collect in (True, False):
        if not collect:
            gc.disable()
        for i in range(runs):
            _answers.clear()
            ours = run_pipeline(driver, cfg)
            gaps = (_gaps() + "\n" + _frees_in(_answers[0][0], _answers[-1][0]) + "\n" + _timeline(_marks[0][0])
                    + f"\n  first answer at +{(_answers[0][0] - _marks[0][0]) * 1e3:.1f} ms")
            raw = raw_pipeline(driver, data, batches, cfg.depth) if not no_raw else ours
            print(f"gc {'on ' if collect else 'off'} run {i}: ours {gbytes / ours.seconds:6.1f} GB/s (ok={ours.ok}), "
                  f"raw {gbytes / raw.seconds:6.1f} GB/s, ratio {raw.seconds / ours.seconds:.3f}", flush=True)
            print(gaps, flush=True)
    gc.enable()
    driver.close()


if __name__ == "__main__":
    main()
