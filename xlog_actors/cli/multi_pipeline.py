"""The demo's job on several devices at once: one pipeline per device (the actors' of
:func:`.pipeline.run_pipeline`, or with ``cfg.graph`` the graph mode's of
:func:`.graph_pipeline.run_graph_pipeline`), every batch of every device verified, all of them
timed from one start.

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

A sticky error (an illegal address, a launch failure) poisons a context for the life of its
process. Isolated, the faulted device's worker process ends and a new worker process for that
ordinal runs the batches it had not verified, up to ``max_restarts`` times per device
(:data:`MAX_RESTARTS`); the other devices run on untouched. Each worker tells the parent how many
of its batches are verified (a ``("progress", verified)`` frame about five times a second, and
its result at the end), so a batch verified is never run again and a batch not verified is never
counted: a worker that dies between two frames has its last count taken, and the batches after
it are run again. In-process, a poisoned device cannot be restarted (its context is the
process's): it is reported as such, and the other devices complete. :class:`InjectedFault` plants
such an error for tests and demonstrations.

Past 400 lines because the two placements share one result and one validation, and the isolated
parent's frames, restarts and combined result are one state machine read best in one place.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from typing import Any, Final, Literal

from ..driver.host import HostDriver
from ..driver.open import open_driver
from ..driver.protocol import Driver
from .graph_pipeline import job_for
from .pipeline import PipelineConfig, PipelineResult

__all__ = [
    "DEFAULT_PLACEMENT", "MAX_RESTARTS", "PLACEMENTS", "DeviceRun", "InjectedFault",
    "MultiResult", "Placement", "run_on_devices",
]

Placement = Literal["isolated", "in-process"]

#: The placements :func:`run_on_devices` takes, the default first.
PLACEMENTS: Final[tuple[Placement, ...]] = ("isolated", "in-process")

#: One worker process per device: its own interpreter lock (the module docstring says why).
DEFAULT_PLACEMENT: Final[Placement] = "isolated"

#: How long a device may take to make its inputs, buffers and kernels before its start.
READY_TIMEOUT_S: Final = 180.0

#: How many times, by default, a device's worker process is replaced after it failed mid-run.
MAX_RESTARTS: Final = 2

#: What an in-process device poisoned by a sticky error is reported with.
POISONED_IN_PROCESS: Final = ("poisoned by a sticky error: its context is unusable for the life of this process, so "
                              "in-process it cannot be restarted (the isolated placement restarts its worker process)")


@dataclass(frozen=True)
class InjectedFault:
    """**Test hook**: a sticky error on device ``ordinal`` when batch ``at`` of its run is copied
    in: a kernel that stores to address 16 (``pipeline.ILLEGAL_STORE``), launched on the device's
    kernel actor, so the batches then in flight meet it. On a GPU it is a real
    ``CUDA_ERROR_ILLEGAL_ADDRESS``; the host driver's checked memory poisons the device alike.

    ``lives``: how many of the device's worker processes meet it (isolated; in-process there is
    one): the first by default, so its restart completes; more than the restarts allowed leaves
    the device failed. A restarted worker counts its own batches from 0 and meets it at
    ``min(at, its batches - 1)``.

    Thread rule: immutable; any thread.
    """

    ordinal: int
    at: int
    lives: int = 1

    def batch_for(self, ordinal: int, life: int, batches: int) -> int | None:
        """The batch at which worker ``life`` (0: the first) of ``ordinal`` running ``batches``
        faults; None where it does not."""
        if ordinal != self.ordinal or life >= self.lives:
            return None
        return min(self.at, batches - 1)


@dataclass(frozen=True)
class DeviceRun:
    """One device's part of a run: its pipeline's result (None when it failed before one came)
    or what failed, and when its clock started (``time.perf_counter``, system-wide).

    ``restarts``: how many times its worker process was replaced after a failure (isolated), and
    ``faults`` what ended each replaced one, in order. With restarts, ``result`` is every worker's
    work together: the batches verified by all of them (each one by one worker only), the
    seconds from the first start to the last end, the restarts included; ``error`` then says why
    the last worker failed, if it did.

    Thread rule: immutable; any thread.
    """

    ordinal: int
    result: PipelineResult | None
    error: str | None = None
    started: float = 0.0
    restarts: int = 0
    faults: tuple[str, ...] = ()

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
    *,
    max_restarts: int = MAX_RESTARTS,
    fault: InjectedFault | None = None,
) -> MultiResult:
    """Run the demo's pipeline on devices ``0 .. count - 1`` at once, one pipeline per device.

    Args:
        kind: the driver kind, ``"cuda"`` or ``"host"`` (what each worker process opens).
        count: how many devices, at least 1.
        cfg: every device's run (``cfg.batches`` batches each).
        placement: ``"isolated"`` (one worker process per device) or ``"in-process"``.
        driver: for ``"in-process"``, the driver of the devices (with at least ``count``); unused
            by ``"isolated"``.
        max_restarts: ``"isolated"``: how many times a device's worker process that failed
            after its start (a sticky error, a death, a timeout) is replaced by a new one running
            the batches not yet verified; >= 0. A wrong result (a mismatched batch) is not retried.
        fault: a sticky error to plant (a test hook, the actor mode's only), or None.
    Returns:
        The result; a device that failed (its driver, its warm-up, its start, its run, past its
        restarts) says so in its ``error`` or its result's ``errors``, and the others still run.
    Raises:
        ValueError: ``count`` < 1, an unknown placement or kind, ``"in-process"`` without a
            driver of ``count`` devices, a config :func:`run_pipeline` refuses, ``max_restarts``
            < 0, a fault outside the devices or the batches, or with ``cfg.graph``.
    Thread rule: any thread but the pipeline's actors'; it blocks until every device is done.
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    if kind not in ("cuda", "host"):
        raise ValueError(f"kind must be 'cuda' or 'host', got {kind!r}")
    if cfg.batch_bytes % 4 or cfg.batch_bytes <= 0 or cfg.batches < 1 or cfg.depth < 1:
        raise ValueError(f"a pipeline config run_pipeline refuses: {cfg}")
    if type(max_restarts) is not int or max_restarts < 0:
        raise ValueError(f"max_restarts must be a non-negative int, got {max_restarts!r}")
    if fault is not None and cfg.graph:
        raise ValueError("a planted fault is the actor pipeline's test hook; the graph mode plants none")
    if fault is not None and not (0 <= fault.ordinal < count and 0 <= fault.at < cfg.batches and fault.lives >= 1):
        raise ValueError(f"a fault on devices 0 .. {count - 1}, batches 0 .. {cfg.batches - 1}, lives >= 1; "
                         f"got {fault}")
    if placement == "isolated":
        return MultiResult(placement, _isolated(kind, count, cfg, max_restarts, fault))
    if placement == "in-process":
        if driver is None or driver.device_count() < count:
            raise ValueError(f"in-process on {count} devices needs a driver of {count} devices, got {driver!r}")
        return MultiResult(placement, _in_process(driver, count, cfg, fault))
    raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")


# -- in-process: one thread per device ------------------------------------------------------------

def _life_cfg(cfg: PipelineConfig, fault: InjectedFault | None, ordinal: int, life: int,
              batches: int) -> PipelineConfig:
    at = fault.batch_for(ordinal, life, batches) if fault is not None else None
    return replace(cfg, batches=batches, fault_at=at) if at is not None or batches != cfg.batches else cfg


def _poisoned(result: PipelineResult) -> bool:
    return any("ContextPoisoned" in error or "poisoned" in error for error in result.errors)


def _in_process(driver: Driver, count: int, cfg: PipelineConfig, fault: InjectedFault | None) -> tuple[DeviceRun, ...]:
    barrier = threading.Barrier(count)
    runs: list[DeviceRun | None] = [None] * count

    def one(ordinal: int) -> None:
        started = [0.0]

        def gate() -> None:
            barrier.wait(READY_TIMEOUT_S)
            started[0] = time.perf_counter()

        try:
            result = job_for(cfg)(driver, _life_cfg(cfg, fault, ordinal, 0, cfg.batches), ordinal=ordinal,
                                  start_gate=gate)
        except BaseException as exc:  # noqa: BLE001 - the device's failure, reported beside the others
            barrier.abort()  # the others stop waiting at their gate
            runs[ordinal] = DeviceRun(ordinal, None, _describe(exc))
            return
        runs[ordinal] = DeviceRun(ordinal, result, POISONED_IN_PROCESS if _poisoned(result) else None, started[0])

    threads = [threading.Thread(target=one, args=(k,), name=f"demo-device-{k}", daemon=True) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tuple(run or DeviceRun(k, None, "its thread ended without a result") for k, run in enumerate(runs))


# -- isolated: one worker process per device ------------------------------------------------------

def _worker(conn: Connection, kind: str, count: int, ordinal: int, cfg: PipelineConfig) -> None:
    """A device's worker process: open the driver, run the pipeline on ``ordinal`` with a start
    gate that says ``ready`` and waits for ``go``, send ``("progress", verified)`` as batches are
    verified, and send the result back."""
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
    sent = [0]

    def gate() -> None:
        conn.send(("ready",))
        if conn.recv() != "go":
            raise RuntimeError("the run was called off before it started")
        started[0] = time.perf_counter()

    def verified(count: int) -> None:
        if count != sent[0]:
            sent[0] = count
            conn.send(("progress", count))

    try:
        result = job_for(cfg)(driver, cfg, ordinal=ordinal, start_gate=gate, on_verified=verified)
        conn.send(("done", result, started[0]))
    except BaseException as exc:  # noqa: BLE001 - sent to the parent
        conn.send(("failed", _describe(exc)))
    finally:
        conn.close()
        try:
            driver.close()
        except BaseException:  # noqa: BLE001 - a poisoned context may refuse; the process ends anyway
            pass


@dataclass
class _Life:
    """One worker process of a device, as the parent sees it."""

    index: int  # 0: the device's first worker
    batches: int  # what it was given: the device's batches not verified before it
    proc: Any
    conn: Connection
    deadline: float  # for its next frame that matters: ready, then its end
    go: bool = False  # its clock started
    verified: int = 0  # its last progress frame
    started: float = 0.0
    ended: float = 0.0
    result: PipelineResult | None = None
    error: str | None = None


@dataclass
class _Device:
    ordinal: int
    lives: list[_Life] = field(default_factory=list)
    verified: int = 0  # by its ended workers

    @property
    def live(self) -> _Life | None:
        life = self.lives[-1] if self.lives else None
        return life if life is not None and life.ended == 0.0 else None


class _Isolated:
    """The parent's side: spawn a worker per device, start them together, follow their frames,
    replace a worker that failed after its start."""

    def __init__(self, kind: str, count: int, cfg: PipelineConfig, max_restarts: int,
                 fault: InjectedFault | None) -> None:
        self.kind, self.count, self.cfg = kind, count, cfg
        self.max_restarts, self.fault = max_restarts, fault
        self.spawn = multiprocessing.get_context("spawn")
        self.devices = [_Device(k) for k in range(count)]

    def spawn_life(self, device: _Device) -> None:
        index, batches = len(device.lives), self.cfg.batches - device.verified
        cfg = _life_cfg(self.cfg, self.fault, device.ordinal, index, batches)
        ours, theirs = self.spawn.Pipe()
        proc = self.spawn.Process(target=_worker, args=(theirs, self.kind, self.count, device.ordinal, cfg),
                                  name=f"xlog-demo-device-{device.ordinal}-{index}", daemon=True)
        proc.start()
        theirs.close()
        device.lives.append(_Life(index, batches, proc, ours, time.monotonic() + READY_TIMEOUT_S))

    def run(self) -> tuple[DeviceRun, ...]:
        try:
            for device in self.devices:
                self.spawn_life(device)
            self.start_together()
            self.follow()
        finally:
            for device in self.devices:
                life = device.live
                if life is not None:
                    self.end(device, life, None, "called off: the run stopped")
        return tuple(self.outcome(device) for device in self.devices)

    def start_together(self) -> None:
        """Every first worker's ``ready`` (or its end), then ``go`` to those ready."""
        for device in self.devices:
            life = device.lives[0]
            while device.live is not None and not life.go:
                frame = self.read(device, life, max(0.0, life.deadline - time.monotonic()))
                if frame is not None and frame[0] == "ready":
                    life.go = True
        for device in self.devices:
            life = device.lives[0]
            if device.live is not None and life.go:
                self.go(life)

    def go(self, life: _Life) -> None:
        life.go = True
        life.started = time.perf_counter()  # the worker's own, once its result comes
        life.deadline = time.monotonic() + self.cfg.timeout_s + 60.0
        try:
            life.conn.send("go")
        except OSError:
            pass  # its end is read next

    def follow(self) -> None:
        """Take the workers' frames until every device is done."""
        while True:
            live = {life.conn: (device, life) for device in self.devices if (life := device.live) is not None}
            if not live:
                return
            soonest = min(life.deadline for _, life in live.values())
            for conn in wait(list(live), max(0.0, soonest - time.monotonic())):
                device, life = live[conn]  # type: ignore[index]  # one of the keys
                frame = self.read(device, life, 0.0)
                if frame is not None and frame[0] == "ready":
                    self.go(life)  # a restarted worker starts on its own
            now = time.monotonic()
            for device, life in live.values():
                if device.live is life and now >= life.deadline:
                    self.end(device, life, None, f"no answer from its worker process in {self.timeout(life):g} s")

    def timeout(self, life: _Life) -> float:
        return self.cfg.timeout_s + 60.0 if life.go else READY_TIMEOUT_S

    def read(self, device: _Device, life: _Life, timeout: float) -> tuple[Any, ...] | None:
        """One frame of ``life`` (waiting up to ``timeout`` s): a progress frame is taken here,
        an end ends the life; the frame, or None when none came."""
        try:
            if not life.conn.poll(timeout):
                if timeout > 0 or time.monotonic() >= life.deadline:
                    self.end(device, life, None, f"no answer from its worker process in {self.timeout(life):g} s")
                return None
            frame: tuple[Any, ...] = life.conn.recv()
        except (EOFError, OSError) as exc:
            life.proc.join(5.0)
            code = life.proc.exitcode
            self.end(device, life, None, f"its worker process ended (exit status {code}): {_describe(exc)}")
            return None
        if frame[0] == "progress":
            life.verified = max(life.verified, int(frame[1]))
        elif frame[0] == "done":
            life.started = frame[2]
            self.end(device, life, frame[1], None)
        elif frame[0] == "failed":
            self.end(device, life, None, str(frame[1]))
        return frame

    def end(self, device: _Device, life: _Life, result: PipelineResult | None, error: str | None) -> None:
        """``life`` is over: stop its process, count what it verified, and replace it where the
        device has batches left, its failure came after its start, and restarts are left."""
        life.ended = time.perf_counter() if result is None else life.started + result.seconds
        life.result, life.error = result, error
        life.conn.close()
        life.proc.join(10.0)
        if life.proc.is_alive():
            life.proc.kill()
            life.proc.join(5.0)
        if result is not None:
            life.verified = result.verified
        device.verified += life.verified
        failed = error is not None or (result is not None and bool(result.errors))
        if (failed and life.go and device.verified < self.cfg.batches
                and not (result is not None and result.mismatched) and life.index < self.max_restarts
                and error != "called off: the run stopped"):
            self.spawn_life(device)

    def outcome(self, device: _Device) -> DeviceRun:
        lives, last = device.lives, device.lives[-1]
        faults = tuple(_why(life) for life in lives[:-1])
        restarts = len(lives) - 1
        if restarts == 0:
            return DeviceRun(device.ordinal, last.result, last.error, last.started)
        first = next((life for life in lives if life.go), last)
        began = first.started or first.ended
        results = [life.result for life in lives if life.result is not None]
        base = last.result or (results[-1] if results else None)
        if base is None:
            return DeviceRun(device.ordinal, None, last.error, began, restarts, faults)
        done = 0
        mismatched: list[int] = []
        for life in lives:  # a worker's batch k is the device's batch (verified before it) + k
            if life.result is not None:
                mismatched += [done + k for k in life.result.mismatched]
            done += life.verified
        combined = replace(
            base,
            batches=self.cfg.batches,
            verified=device.verified,
            mismatched=mismatched,
            stale_retries=sum(r.stale_retries for r in results),
            errors=list(last.result.errors) if last.result is not None else [],
            seconds=max(life.ended for life in lives) - began,
            compared=sum(r.compared for r in results),
            extra={**base.extra, "cpu_seconds": sum(r.extra.get("cpu_seconds", 0.0) for r in results),
                   "verified_by_worker": [life.verified for life in lives]},
        )
        return DeviceRun(device.ordinal, combined, last.error, began, restarts, faults)


def _why(life: _Life) -> str:
    """What ended a worker that was replaced."""
    if life.error is not None:
        return life.error
    errors = life.result.errors if life.result is not None else ["no result"]
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{life.verified}/{life.batches} verified, then: {errors[0] if errors else 'no error'}{more}"


def _isolated(kind: str, count: int, cfg: PipelineConfig, max_restarts: int,
              fault: InjectedFault | None) -> tuple[DeviceRun, ...]:
    return _Isolated(kind, count, cfg, max_restarts, fault).run()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"
