"""The demo's job on several devices at once: one pipeline (:func:`.pipeline.run_pipeline`) per
device, every batch of every device verified, all of them timed from one start.

Two placements:

* ``"isolated"`` (the default): one worker process per device (``multiprocessing``, spawned),
  each opening its own driver and running the whole pipeline on its device there: its
  ``DeviceActor``, its three library actors and its orchestrating thread. Each device then has an
  interpreter lock of its own, so the per-batch Python cost of one device never waits for
  another's. It is the placement that scales: in one process every device's actors and
  orchestrator share one interpreter lock, and the devices together are bounded by what one lock
  lets through. (The parent keeps no device of its own while they run.)
  On CUDA each worker first binds itself to the CPUs of its GPU's NUMA node
  (:mod:`..driver.cuda.topology`), so its pinned memory and its copies stay on that node.
* ``"in-process"``: one ``DeviceActor`` per ordinal of one driver in this process and one
  orchestrating thread per device, all under one interpreter lock: what a program that does not
  want worker processes gets, and the yardstick that shows what the lock costs.

Every device's pipeline makes its inputs, buffers and kernels first and then waits at a start
gate; once every device is ready the clocks start together. Each device reports its own seconds
and the ``time.perf_counter`` at its start (``CLOCK_MONOTONIC``, one clock for every process of
the machine), so the aggregate throughput is every device's bytes over the span from the first
start to the last end.

On the host driver each worker emulates ``count`` devices (``HostDriver(device_count=count)``)
and drives one of them; in-process, the caller's driver must have ``count`` devices.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Final, Literal

from ..driver.host import HostDriver
from ..driver.open import open_driver
from ..driver.protocol import Driver
from .pipeline import PipelineConfig, PipelineResult, run_pipeline

__all__ = [
    "DEFAULT_PLACEMENT", "HOST_MAX_DEVICES", "PLACEMENTS", "DeviceRun", "MultiResult", "Placement",
    "run_on_devices",
]

Placement = Literal["isolated", "in-process"]

#: The placements :func:`run_on_devices` takes, the default first.
PLACEMENTS: Final[tuple[Placement, ...]] = ("isolated", "in-process")

#: One worker process per device: its own interpreter lock (the module docstring says why).
DEFAULT_PLACEMENT: Final[Placement] = "isolated"

#: The most devices the host driver is asked to emulate for a run (one worker process each).
HOST_MAX_DEVICES: Final = 16

#: How long a device may take to make its inputs, buffers and kernels before its start.
READY_TIMEOUT_S: Final = 180.0


@dataclass(frozen=True)
class DeviceRun:
    """One device's part of a run: its pipeline's result (None when it failed before one came)
    or what failed, and when its clock started (``time.perf_counter``, system-wide).

    Thread rule: immutable; any thread.
    """

    ordinal: int
    result: PipelineResult | None
    error: str | None = None
    started: float = 0.0

    @property
    def ok(self) -> bool:
        """The device's every batch verified, and nothing failed."""
        return self.error is None and self.result is not None and self.result.ok

    @property
    def ended(self) -> float:
        """When the device's clock stopped (``started`` + its seconds)."""
        return self.started + (self.result.seconds if self.result is not None else 0.0)

    @property
    def throughput_bytes_s(self) -> float:
        """The device's input bytes per second over its own timed part (0 without a result)."""
        return self.result.throughput_bytes_s if self.result is not None else 0.0


@dataclass(frozen=True)
class MultiResult:
    """A run on several devices: the placement and each device's part.

    Thread rule: immutable; any thread.
    """

    placement: Placement
    runs: tuple[DeviceRun, ...]

    @property
    def ok(self) -> bool:
        """Every device's every batch verified."""
        return bool(self.runs) and all(run.ok for run in self.runs)

    @property
    def seconds(self) -> float:
        """From the first device's start to the last device's end (0 when none ran)."""
        timed = [run for run in self.runs if run.result is not None]
        if not timed:
            return 0.0
        return max(run.ended for run in timed) - min(run.started for run in timed)

    @property
    def total_bytes(self) -> int:
        """Input bytes of every device's batches (of the devices that ran)."""
        return sum(run.result.batches * run.result.batch_bytes for run in self.runs if run.result is not None)

    @property
    def throughput_bytes_s(self) -> float:
        """Every device's input bytes over :attr:`seconds`: the aggregate throughput."""
        seconds = self.seconds
        return self.total_bytes / seconds if seconds > 0 else 0.0


def run_on_devices(
    kind: str,
    count: int,
    cfg: PipelineConfig,
    placement: Placement = DEFAULT_PLACEMENT,
    driver: Driver | None = None,
) -> MultiResult:
    """Run the demo's pipeline on devices ``0 .. count - 1`` at once, one pipeline per device.

    Args:
        kind: the driver kind, ``"cuda"`` or ``"host"`` (what each worker process opens).
        count: how many devices, at least 1.
        cfg: every device's run (``cfg.batches`` batches each).
        placement: ``"isolated"`` (one worker process per device) or ``"in-process"``.
        driver: for ``"in-process"``, the driver of the devices (with at least ``count``); unused
            by ``"isolated"``.
    Returns:
        The result; a device that failed (its driver, its warm-up, its start, its run) says so in
        its ``error`` and the others still run.
    Raises:
        ValueError: ``count`` < 1, an unknown placement or kind, ``"in-process"`` without a
            driver of ``count`` devices, or a config :func:`run_pipeline` refuses.
    Thread rule: any thread but the pipeline's actors'; it blocks until every device is done.
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    if kind not in ("cuda", "host"):
        raise ValueError(f"kind must be 'cuda' or 'host', got {kind!r}")
    if cfg.batch_bytes % 4 or cfg.batch_bytes <= 0 or cfg.batches < 1 or cfg.depth < 1:
        raise ValueError(f"a pipeline config run_pipeline refuses: {cfg}")
    if placement == "isolated":
        return MultiResult(placement, _isolated(kind, count, cfg))
    if placement == "in-process":
        if driver is None or driver.device_count() < count:
            raise ValueError(f"in-process on {count} devices needs a driver of {count} devices, got {driver!r}")
        return MultiResult(placement, _in_process(driver, count, cfg))
    raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")


# -- in-process: one thread per device ------------------------------------------------------------

def _in_process(driver: Driver, count: int, cfg: PipelineConfig) -> tuple[DeviceRun, ...]:
    barrier = threading.Barrier(count)
    runs: list[DeviceRun | None] = [None] * count

    def one(ordinal: int) -> None:
        started = [0.0]

        def gate() -> None:
            barrier.wait(READY_TIMEOUT_S)
            started[0] = time.perf_counter()

        try:
            result = run_pipeline(driver, cfg, ordinal=ordinal, start_gate=gate)
        except BaseException as exc:  # noqa: BLE001 - the device's failure, reported beside the others
            barrier.abort()  # the others stop waiting at their gate
            runs[ordinal] = DeviceRun(ordinal, None, _describe(exc))
            return
        runs[ordinal] = DeviceRun(ordinal, result, None, started[0])

    threads = [threading.Thread(target=one, args=(k,), name=f"demo-device-{k}", daemon=True) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tuple(run or DeviceRun(k, None, "its thread ended without a result") for k, run in enumerate(runs))


# -- isolated: one worker process per device ------------------------------------------------------

def _worker(conn: Connection, kind: str, count: int, ordinal: int, cfg: PipelineConfig) -> None:
    """A device's worker process: open the driver, run the pipeline on ``ordinal`` with a start
    gate that says ``ready`` and waits for ``go``, and send the result back."""
    if kind == "cuda":
        # Before anything is allocated: pinned memory lands on the node of the CPU that first
        # touches it, and a copy to a GPU of the other node crosses the inter-socket link.
        from ..driver.cuda.topology import bind_to_device

        bind_to_device(ordinal)
    try:
        driver = HostDriver(device_count=count) if kind == "host" else open_driver("cuda")
    except BaseException as exc:  # noqa: BLE001 - sent to the parent
        conn.send(("failed", f"opening the {kind} driver: {_describe(exc)}"))
        return
    started = [0.0]

    def gate() -> None:
        conn.send(("ready",))
        if conn.recv() != "go":
            raise RuntimeError("the run was called off before it started")
        started[0] = time.perf_counter()

    try:
        result = run_pipeline(driver, cfg, ordinal=ordinal, start_gate=gate)
        conn.send(("done", result, started[0]))
    except BaseException as exc:  # noqa: BLE001 - sent to the parent
        conn.send(("failed", _describe(exc)))
    finally:
        driver.close()
        conn.close()


def _isolated(kind: str, count: int, cfg: PipelineConfig) -> tuple[DeviceRun, ...]:
    spawn = multiprocessing.get_context("spawn")
    conns: list[Connection] = []
    procs: list[Any] = []
    runs: dict[int, DeviceRun] = {}
    try:
        for ordinal in range(count):
            ours, theirs = spawn.Pipe()
            proc = spawn.Process(target=_worker, args=(theirs, kind, count, ordinal, cfg),
                                 name=f"xlog-demo-device-{ordinal}", daemon=True)
            proc.start()
            theirs.close()
            conns.append(ours)
            procs.append(proc)
        ready = _gather(conns, runs, READY_TIMEOUT_S, lambda frame: frame[0] == "ready")
        for ordinal in ready:
            conns[ordinal].send("go")
        _gather(conns, runs, cfg.timeout_s + 60.0, lambda frame: False, only=ready)
    finally:
        for conn in conns:
            conn.close()
        for proc in procs:
            proc.join(10.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
    return tuple(runs.get(k) or DeviceRun(k, None, "its worker process ended without a result") for k in range(count))


def _gather(conns: list[Connection], runs: dict[int, DeviceRun], timeout: float,
            is_step: Callable[[tuple[Any, ...]], bool], only: list[int] | None = None) -> list[int]:
    """Read one frame from each worker (of ``only``, else all) within ``timeout``: the ordinals
    whose frame ``is_step``; a result or a failure goes into ``runs``."""
    stepped: list[int] = []
    deadline = time.monotonic() + timeout
    for ordinal in range(len(conns)) if only is None else only:
        conn = conns[ordinal]
        try:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                runs[ordinal] = DeviceRun(ordinal, None, f"no answer from its worker process in {timeout:g} s")
                continue
            frame = conn.recv()
        except (EOFError, OSError) as exc:
            runs[ordinal] = DeviceRun(ordinal, None, f"its worker process ended: {_describe(exc)}")
            continue
        if is_step(frame):
            stepped.append(ordinal)
        elif frame[0] == "done":
            runs[ordinal] = DeviceRun(ordinal, frame[1], None, frame[2])
        else:
            runs[ordinal] = DeviceRun(ordinal, None, str(frame[1]))
    return stepped


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"
