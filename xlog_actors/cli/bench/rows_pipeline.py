"""The demo rows: the main job (copy in, kernel, copy out of every batch, each verified by a device
checksum) at three batch sizes, in both modes, each beside the tight raw three-stream pipeline of
:mod:`..raw_pipeline` over the same batches on the same device. One sample is one whole run.

* ``demo pipeline <size>``: :func:`..pipeline.run_pipeline`, three library actors (their asks
  served in the orchestrating thread while they are idle);
* ``demo graph <size>``: :func:`..graph_pipeline.run_graph_pipeline`, the ring's slots recorded
  as ``BatchGraph`` lanes, as many batches a replay as :func:`..graph_pipeline.lanes_for` gives
  for the size (the row's description says how many).

Each row's note carries the CPU time of the process (all threads) per batch over the timed part,
ours and the raw twin's, medians over the rounds.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from ..batches import BatchData
from ..graph_pipeline import lanes_for, run_graph_pipeline
from ..pipeline import PipelineConfig, PipelineResult, run_pipeline
from ..raw_pipeline import raw_pipeline
from .harness import Context, Group, Row, given, no_gc
from .plan import Plan, size_text
from .result import Target

__all__ = ["DEPTH", "PIPELINE"]

#: Batches in flight in every demo row (the ring's buffer sets), ours and the twin's.
DEPTH = 8

_Runner = Callable[..., PipelineResult]
_MODES: dict[str, tuple[_Runner, str]] = {
    "pipeline": (run_pipeline, "run_pipeline: copy in -> kernel -> copy out asked of a CopyActor, a KernelActor "
                 "and a CopyActor on 3 streams"),
    "graph": (run_graph_pipeline, "run_graph_pipeline: copy in -> kernel -> copy out of each ring slot recorded once "
              "as a lane of a BatchGraph, each replay one batch a lane, its inputs bound per batch"),
}


class _Cpu:
    """The CPU seconds per batch of the rounds of one row, ours and the twin's."""

    def __init__(self) -> None:
        self.ours: list[float] = []
        self.ref: list[float] = []

    def note(self) -> str:
        if not self.ours or not self.ref:
            return ""
        return (f"CPU per batch, all threads of the process, median of {len(self.ours)} rounds: ours "
                f"{statistics.median(self.ours) * 1e6:.1f} us, raw twin {statistics.median(self.ref) * 1e6:.1f} us")


def _measure(mode: str, size: int, cpu: _Cpu) -> Callable[[Any, Context], tuple[list[float], list[float]]]:
    run, _ = _MODES[mode]

    def measure(_fixture: Any, ctx: Context) -> tuple[list[float], list[float]]:
        """Whole runs of ours and the raw twin, alternating per round (after a warm-up of each)."""
        driver, plan = ctx.driver, ctx.plan
        nbytes, batches = _size(plan, size)
        cfg = PipelineConfig(batches=batches, batch_bytes=nbytes, depth=DEPTH)
        data = BatchData(DEPTH + 1, nbytes)  # built once: the raw runs measure copies and kernels only

        def ours() -> float:
            result = run(driver, cfg)
            if not result.ok:
                raise RuntimeError(
                    f"demo {mode} failed: verified {result.verified}/{result.batches}, "
                    f"mismatched {result.mismatched[:10]}, errors {result.errors[:3]}"
                )
            cpu.ours.append(float(result.extra["cpu_seconds"]) / batches)
            return result.seconds

        def ref() -> float:
            raw = raw_pipeline(driver, data, batches, DEPTH)
            cpu.ref.append(raw.cpu_seconds / batches)
            return raw.seconds

        # warm up: NVRTC compile and module load, pool growth, pinned allocation
        warm = run(driver, PipelineConfig(batches=min(4 * DEPTH, batches), batch_bytes=nbytes, depth=DEPTH))
        if not warm.ok:
            raise RuntimeError(f"demo {mode} warm-up failed verification: {warm.errors[:3]}")
        raw_pipeline(driver, data, min(4 * DEPTH, batches), DEPTH)
        cpu.ours.clear()
        cpu.ref.clear()
        a: list[float] = []
        b: list[float] = []
        with no_gc():
            for r in range(max(1, plan.pipe_rounds)):
                if r & 1:
                    b.append(ref() * 1e9)
                    a.append(ours() * 1e9)
                else:
                    a.append(ours() * 1e9)
                    b.append(ref() * 1e9)
        return a, b

    return measure


def _size(plan: Plan, size: int) -> tuple[int, int]:
    """(batch bytes, batches) of the plan's ``size``-th demo size."""
    return plan.pipe_sizes[size]


#: (mode, size index) -> its target: ratio of our throughput to the tight raw twin's.
_TARGETS = {
    ("pipeline", 0): 0.3, ("pipeline", 1): 0.5, ("pipeline", 2): 0.95,
    ("graph", 0): 2.0, ("graph", 1): 0.95, ("graph", 2): 0.95,
}


def _lanes_text(mode: str, plan: Plan, size: int) -> str:
    """How many batches a replay of the graph mode sends at this size ("" for the actor mode)."""
    if mode != "graph":
        return ""
    lanes = lanes_for(PipelineConfig(batch_bytes=_size(plan, size)[0], depth=DEPTH))
    return f", {lanes} batch{'es' if lanes > 1 else ''} a replay"


def _row(mode: str, size: int, label: str) -> Row:
    cpu = _Cpu()
    what = _MODES[mode][1]
    return Row(
        f"demo {mode} {label}",
        lambda f, p: f"{what}: {_size(p, size)[1]} batches of {size_text(_size(p, size)[0])}, {DEPTH} in flight"
        f"{_lanes_text(mode, p, size)}, each verified by a device checksum",
        given, None, None, lambda p: (p.pipe_rounds, 1),
        reference=f"the tight raw three-stream pipeline: the same copies and kernel on 3 streams ordered by events, "
        f"a ring of {DEPTH} device buffer pairs, pinned host buffers, every handle and argument made before the "
        "clock (raw cuda.bindings calls; HostDriver calls on the host driver)",
        kind="rate",
        bytes_per_op=lambda p: _size(p, size)[0] * _size(p, size)[1],
        target=Target("ratio", ">=", _TARGETS[(mode, size)]),
        note=lambda f, p: "throughput counts input bytes per second; one sample is one whole run, its setup "
        "(inputs, buffers, kernels, graphs) excluded on both sides. " + cpu.note(),
        measure=_measure(mode, size, cpu),
    )


PIPELINE = Group("pipeline", tuple(
    _row(mode, size, label)
    for size, label in enumerate(("64 KiB", "1 MiB", "16 MiB"))
    for mode in ("pipeline", "graph")
))
