"""One device under chaos: start it (in process, or isolated in its own process), load it from
the run's threads, inject its faults, then check everything it must have given back, and stop
it and check it left nothing behind. Its verdicts go to its own :class:`~.ledger.Ledger`.

The in-process device runs on ``HostDriver(shared=True)`` (its memory in shared memory, so its
handles pickle to the workers) or ``CudaDriver(ipc_pool=True)`` (an IPC-capable pool); the
isolated one is ``DeviceActor.start(0, kind, isolate=True)`` (``ipc_pool=True`` on the GPU).
"""

from __future__ import annotations

import gc
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import pykka

from ... import (
    AllocateMany,
    CopyActor,
    CopyToDevice,
    CopyToHost,
    DeviceActor,
    Free,
    GetStats,
    HostDriver,
    In,
    KernelActor,
    Launch,
    Out,
    Rebuild,
)
from ...errors import XlogError
from ...kernels import FILL_F32, SCALE_ADD_F32, launch_shape
from .faults import RESTART_TIMEOUT_S, CountingSupervisor, FaultInjector, InProcessFaults, IsolatedFaults
from .ledger import Ledger, Lost, Watch, ask, say
from .leftovers import check_leftovers, device_processes
from .load import ASK_TIMEOUT_S, LoadThread, Target
from .workers import MESSAGE_TIMEOUT_S, WorkerPool

__all__ = ["GRACE_S", "MEMORY_SLACK", "PHASES", "ChaosConfig", "DevicePhase"]

#: The two devices, in the order they run.
PHASES = ("in-process", "isolated")
#: Slack past a wait's own bound before it counts as a hang.
GRACE_S = 15.0
#: Device memory may stay this far below its idle reading at the end.
MEMORY_SLACK = 64 << 20
#: The host driver's device memory (sparse: committed only where touched).
HOST_MEMORY = 512 << 20
#: How long the figures may take to come back to zero once every handle is dropped.
SETTLE_S = 20.0
#: A progress line this often, on stderr.
PROGRESS_S = 5.0


@dataclass(frozen=True)
class ChaosConfig:
    """The parsed flags of ``xlog-actors chaos``.

    Thread rule: immutable; any thread.
    """

    seconds: float
    seed: int
    threads: int
    workers: int
    fault_every: float
    devices: tuple[str, ...]
    driver: str

    @property
    def seconds_each(self) -> float:
        """The seconds of load each device gets (``seconds`` split between them).

        Thread rule: any thread.
        """
        return self.seconds / len(self.devices)


class DevicePhase:
    """One device's part of the run; see the module docstring.

    Thread rule: the run's main thread.
    """

    def __init__(self, name: str, config: ChaosConfig, workers: WorkerPool | None, ledger: Ledger) -> None:
        """Args:
            name: ``"in-process"`` or ``"isolated"``.
            config: the run's configuration.
            workers: the worker processes (None: no handles are sent).
            ledger: this device's column.
        """
        self.name = name
        self.config = config
        self.workers = workers
        self.ledger = ledger
        self.isolated = name == "isolated"
        self.index = PHASES.index(name)
        self.watch = Watch(f"{name} main")
        self.device_pids: set[int] = set()
        self._worker_pids = list(workers.pids) if workers is not None else []

    def notice(self) -> None:
        """Remember the device processes alive now (for the leftover checks).

        Thread rule: any thread.
        """
        if self.isolated:
            self.device_pids |= device_processes(self._worker_pids)

    def _ask(self, device: pykka.ActorRef[Any], message: Any) -> Any:
        return ask(self.ledger, self.watch, device, message, ASK_TIMEOUT_S)

    def run(self) -> None:
        """Start the device, load it, check it, stop it, check what it left.

        Raises:
            XlogError: the device could not be started.
        Thread rule: the run's main thread.
        """
        self.ledger.ran = True
        before = set(threading.enumerate())
        supervisor = CountingSupervisor()
        driver: Any = None
        kind = self.config.driver
        # An isolated device's memory is read from this process, before it starts and after it
        # stopped (its processes, the hot spare's context among them, gone): a reading taken by the
        # device itself would count the spare's context or not, depending on when it opened.
        probe = self._open_probe(kind) if self.isolated else None
        baseline = None if probe is None else probe.mem_info(0)[0]
        if self.isolated:
            device = DeviceActor.start(0, kind, supervisor=supervisor, isolate=True, ipc_pool=kind == "cuda")
        else:
            driver = self._open_driver(kind)
            try:
                device = DeviceActor.start(0, driver, supervisor=supervisor)
            except BaseException:
                driver.close()
                raise
        actors: list[pykka.ActorRef[Any]] = []
        try:
            self.notice()
            actors = [CopyActor.start(device), CopyActor.start(device), KernelActor.start(device)]
            target = Target(self.name, device, (actors[0], actors[1]), actors[2], self.ledger)
            self._warm_up(target)
            idle = None if self.isolated else self._mem_free(device, driver)
            injector = self._injector(device, driver)
            threads = self._load(target, injector)
            self._check_end(device, driver, threads, injector, supervisor, idle)
        finally:
            self.ledger.stopping = True
            for actor in [*actors, device]:
                actor.stop()
            if driver is not None:
                driver.close()
        if probe is not None:
            try:
                self._check_memory(baseline, self._settled_free(probe))
            finally:
                probe.close()
        check_leftovers(self.ledger, processes=self.device_pids, workers=self._worker_pids,
                        segment_owners={os.getpid(), *self.device_pids}, threads_before=before)

    @staticmethod
    def _open_driver(kind: str) -> Any:
        if kind == "host":
            return HostDriver(memory_per_device=HOST_MEMORY, shared=True)
        from ... import CudaDriver

        return CudaDriver(ipc_pool=True)

    def _mem_free(self, device: pykka.ActorRef[Any], driver: Any) -> int | None:
        """Free device memory now: the driver's ``mem_info``, in this process or the device's."""
        if driver is not None:
            free: int = driver.mem_info(0)[0]
            return free
        try:
            value: int | None = self._ask(device, GetStats()).mem_free
        except (XlogError, Lost):
            return None
        return value

    def _warm_up(self, target: Target) -> None:
        """One batch and one fill before the idle reading, so that what the first use loads (the
        kernels' modules, the streams' first work) is in it."""
        n = 1024
        grid, block = launch_shape(n)
        try:
            x, out = self._ask(target.device, AllocateMany([4 * n, 4 * n]))
            self._ask(target.copiers[0], CopyToDevice(x, bytes(4 * n)))
            self._ask(target.kernels, Launch(FILL_F32, grid, block, [Out(x), 1.0, n]))
            self._ask(target.kernels, Launch(SCALE_ADD_F32, grid, block, [Out(out), In(x), 2.0, 1.0, n]))
            self._ask(target.copiers[1], CopyToHost(out))
            for ref in (x, out):
                self._ask(target.device, Free(ref))
        except (XlogError, Lost):
            pass  # recorded; the load will meet it again

    def _injector(self, device: pykka.ActorRef[Any], driver: Any) -> FaultInjector:
        seed = self.config.seed * 1_000_003 + self.index * 1000 + 999
        args = (self.name, device, self.ledger, seed, self.config.fault_every, ASK_TIMEOUT_S)
        if self.isolated:
            return IsolatedFaults(*args, self.config.driver, self._worker_pids, self.notice)
        return InProcessFaults(*args, driver)

    def _load(self, target: Target, injector: FaultInjector) -> list[LoadThread]:
        """Run the load threads and the injector for the device's seconds; join them all."""
        stop = threading.Event()
        threads = [
            LoadThread(i, target, self.config.seed * 1_000_003 + self.index * 1000 + i, self.workers, stop)
            for i in range(self.config.threads)
        ]
        for thread in threads:
            thread.start()
        injector.start()
        started = time.monotonic()
        end = started + self.config.seconds_each
        progress = started + PROGRESS_S
        watches = [t.watch for t in threads] + [injector.watch]
        while (now := time.monotonic()) < end:
            time.sleep(min(0.2, max(0.0, end - now)))
            self._tick(watches)
            if time.monotonic() >= progress:
                progress += PROGRESS_S
                self._progress(time.monotonic() - started)
        stop.set()
        injector.stop()
        self._join([*threads, injector], watches, ASK_TIMEOUT_S + RESTART_TIMEOUT_S + GRACE_S)
        return threads

    def _tick(self, watches: list[Watch]) -> None:
        now = time.monotonic()
        for watch in watches:
            message = watch.overdue(now, GRACE_S)
            if message is not None:
                self.ledger.broke("hangs", message)
        if self.workers is not None:
            self.workers.check_overdue()
        self.notice()

    def _join(self, threads: list[threading.Thread], watches: list[Watch], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            time.sleep(0.1)
            self._tick(watches)
        for thread in threads:
            if thread.is_alive():
                self.ledger.broke("hangs", f"{thread.name} did not end within {timeout_s:.0f} s of the load's end")
            else:
                self.ledger.passed("hangs")

    def _progress(self, elapsed: float) -> None:
        counts = self.ledger.counts()
        say(f"[{self.name}] {elapsed:.0f}/{self.config.seconds_each:.0f} s: "
            f"{counts.get('asks answered', 0)} asks answered, {counts.get('batches verified', 0)} batches verified, "
            f"{counts.get('faults injected', 0)} faults, {self.ledger.broken} broken")

    def _check_end(self, device: pykka.ActorRef[Any], driver: Any, threads: list[LoadThread],
                   injector: FaultInjector, supervisor: CountingSupervisor, idle: int | None) -> None:
        """Everything given back: messages answered, 0 bytes and blocks, memory, the accounting."""
        if self.workers is not None:
            self.workers.drain(self.ledger, MESSAGE_TIMEOUT_S)
        for thread in threads:
            thread.release()
        gc.collect()
        stats = self._settled_stats(device)
        if stats is None:
            self.ledger.broke("outstanding", "GetStats was never answered with figures at the end")
            return
        if stats.bytes_outstanding or stats.live_blocks:
            by_tag = (stats.report or {}).get("by_tag", {})
            self.ledger.broke("outstanding", f"{stats.bytes_outstanding} bytes in {stats.live_blocks} blocks "
                                             f"outstanding {SETTLE_S:.0f} s after every handle was dropped "
                                             f"(by tag: {by_tag})")
        else:
            self.ledger.passed("outstanding")
        self._check_accounting(stats, injector, supervisor)
        if idle is not None:
            # The pool keeps freed memory cached (its release threshold is the whole device): a
            # rebuild gives it back, so what stays below idle after it is memory lost.
            try:
                self._ask(device, Rebuild("chaos: the end of the run gives the pool's cache back"))
            except (XlogError, Lost):
                pass  # recorded by the ask
            self._check_memory(idle, self._mem_free(device, driver))

    def _check_memory(self, idle: int | None, end: int | None) -> None:
        if idle is None or end is None:
            return
        if idle - end > MEMORY_SLACK:
            self.ledger.broke("memory", f"{(idle - end) / (1 << 20):.1f} MiB less free than at idle "
                                        f"({idle} then, {end} now)")
        else:
            self.ledger.passed("memory")
        self.ledger.set_count("device memory below idle at the end (MiB)", round((idle - end) / (1 << 20)))

    @staticmethod
    def _open_probe(kind: str) -> Any:
        """A CUDA driver of this process to read device memory with (None on the host driver, whose
        memory an isolated device's process holds alone)."""
        if kind != "cuda":
            return None
        from ... import CudaDriver

        probe = CudaDriver()
        probe.mem_info(0)  # its context is made now, so both readings count it
        return probe

    @staticmethod
    def _settled_free(probe: Any) -> int:
        """Free memory once the stopped device's processes are gone (their contexts go with them,
        after the process ends): read until it stops rising, 10 s at most."""
        deadline = time.monotonic() + 10.0
        free: int = probe.mem_info(0)[0]
        while time.monotonic() < deadline:
            time.sleep(0.25)
            now: int = probe.mem_info(0)[0]
            if now <= free:
                return max(now, free)
            free = now
        return free

    def _settled_stats(self, device: pykka.ActorRef[Any]) -> Any:
        deadline = time.monotonic() + SETTLE_S
        stats = None
        while True:
            try:
                stats = self._ask(device, GetStats())
            except (XlogError, Lost):
                pass
            if (stats is not None and not stats.bytes_outstanding and not stats.live_blocks) or (
                    time.monotonic() > deadline):
                return stats
            time.sleep(0.1)
            gc.collect()

    def _check_accounting(self, stats: Any, injector: FaultInjector, supervisor: CountingSupervisor) -> None:
        generation, counted, rebuilds = stats.generation, supervisor.counted, injector.rebuilds
        self.ledger.set_count("generation at the end", generation)
        self.ledger.set_count("Rebuilds answered", rebuilds)
        self.ledger.set_count("restarts counted by the supervisor", counted)
        self.ledger.set_count("DeviceStats.restarts", stats.restarts)
        if stats.status == "stopped":
            self.ledger.broke("restarts", "the device stopped for good (its restart intensity is never reached "
                                          "by this run)")
        if isinstance(injector, IsolatedFaults):
            deaths = injector.deaths
            self.ledger.set_count("deaths of the serving process caused", deaths)
            if counted != deaths:
                self.ledger.broke("restarts", f"{counted} restarts counted for {deaths} deaths of the serving "
                                              f"process, with {injector.reserves_killed} reserve process(es) killed "
                                              "(only a death of the serving process is a restart)")
            else:
                self.ledger.passed("restarts")
            explained = rebuilds + deaths
        else:
            planted = injector.planted if isinstance(injector, InProcessFaults) else 0
            if counted > planted:
                self.ledger.broke("restarts", f"{counted} restarts counted for {planted} driver faults planted")
            else:
                self.ledger.passed("restarts")
            explained = rebuilds + counted
        if generation != explained:
            self.ledger.broke("restarts", f"generation {generation} at the end, but {rebuilds} Rebuilds answered "
                                          f"and {explained - rebuilds} restarts make {explained}")
        else:
            self.ledger.passed("restarts")
