"""The faults of a chaos run, one injector thread per device, every few seconds (a random
interval around ``--fault-every``), and the supervisor that counts the restarts it allows. The
kinds come in rounds: each kind once per round, in an order the seed shuffles.

* **In-process device**: ``Rebuild`` (a new generation, not a failure), and on the host driver
  ``HostDriver.inject_fault(0, kind, after_calls)`` with ``kind`` one of ``"context_lost"`` (the
  supervisor rebuilds: a restart), ``"error"`` (a ``DriverError``, context intact) and ``"oom"``
  (``OutOfMemory``), planted a random number of driver calls ahead so that any thread's call may
  meet it. No sticky error: a real one ends a process by design. On the GPU there is no
  injection: ``Rebuild`` only.
* **Isolated device**: a sticky error in the device process (``ChildFault("sticky")`` on the host
  driver, ``ChildFault("illegal_address")``, a kernel writing address 16, on the GPU), a
  ``SIGKILL`` of the serving process (its pid from ``ChildTimeline``), a ``SIGKILL`` of the
  reserve process when one is up (the other ``multiprocessing`` children of this process than
  the workers), both (the reserve, then the serving process: the new process must come from a
  fresh start), and ``Rebuild``. After each death of the serving process the injector waits
  until a new process serves the next generation.

Each device's accounting must hold at the end: its generation equals the ``Rebuild``\\ s answered
plus the restarts its supervisor counted; an isolated device counts exactly one restart per death
of its serving process (a reserve's death is not a restart of the device); an in-process device
counts at most one per fault planted.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pykka

from ... import GetStats, HostDriver, Rebuild, Supervisor
from ...actors.isolated import ChildFault, ChildTimeline
from ...errors import XlogError
from .ledger import Ledger, Lost, Watch, ask
from .leftovers import device_processes

__all__ = ["RESTART_TIMEOUT_S", "CountingSupervisor", "FaultInjector", "InProcessFaults", "IsolatedFaults"]

#: How long a device may take to serve again after a death of its serving process.
RESTART_TIMEOUT_S = 60.0
#: A restart intensity the run never reaches: its restarts are counted, not limited.
MAX_RESTARTS = 1_000_000


class CountingSupervisor(Supervisor):
    """A ``Supervisor`` with an intensity the run never reaches, that counts the restarts it is
    asked to allow (``allow_restart``: what the device counts against the intensity).

    Thread rule: any thread (one lock).
    """

    def __init__(self) -> None:
        super().__init__(max_restarts=MAX_RESTARTS, within_s=60.0)
        self._count_lock = threading.Lock()
        self.counted = 0

    def allow_restart(self, device_id: int, now: float | None = None) -> bool:
        """Count one restart, then decide as ``Supervisor`` does.

        Args:
            device_id: the device.
            now: the time (``time.monotonic()``), None for now.
        Returns:
            Whether the restart is allowed.
        Thread rule: any thread.
        """
        with self._count_lock:
            self.counted += 1
        return super().allow_restart(device_id, now)


class FaultInjector(threading.Thread):
    """Injects a fault every few seconds into one device until stopped; see the module docstring.

    Thread rule: ``start``/``stop``/``join`` from the run's main thread; the faults on its own.
    """

    kinds: tuple[str, ...] = ()

    def __init__(self, name: str, device: pykka.ActorRef[Any], ledger: Ledger, seed: int, every_s: float,
                 ask_timeout_s: float) -> None:
        """Args:
            name: the device's column name.
            device: the device's ``ActorRef``.
            ledger: its ledger.
            seed: the fault schedule's seed.
            every_s: the mean interval between faults.
            ask_timeout_s: each ask's bound.
        """
        super().__init__(name=f"xlog-chaos-faults-{name}", daemon=True)
        self.device = device
        self.ledger = ledger
        self.rng = random.Random(seed)
        self.every_s = every_s
        self.ask_timeout_s = ask_timeout_s
        self.watch = Watch(self.name)
        self.rebuilds = 0
        self._stop_event = threading.Event()

    def stop(self) -> None:
        """No fault after the one in progress.

        Thread rule: any thread.
        """
        self._stop_event.set()

    def run(self) -> None:
        """Inject faults until stopped.

        Thread rule: this thread.
        """
        deck: list[str] = []
        try:
            while not self._stop_event.wait(self.rng.uniform(0.5, 1.5) * self.every_s):
                if not deck:  # every kind once per round, in a random order: none is left out by chance
                    deck = list(self.kinds)
                    self.rng.shuffle(deck)
                kind = deck.pop()
                try:
                    self.inject(kind)
                except (XlogError, Lost):
                    pass  # recorded where it was answered
        except Exception as exc:  # noqa: BLE001 - recorded: the injector itself failed
            self.ledger.broke("answered", f"the fault injector ended on {type(exc).__name__}: {exc}")

    def inject(self, kind: str) -> None:
        """Inject one fault of ``kind``.

        Args:
            kind: one of ``kinds``.
        Raises:
            XlogError, Lost: from the asks.
        Thread rule: this thread.
        """
        raise NotImplementedError

    def _ask(self, message: Any) -> Any:
        return ask(self.ledger, self.watch, self.device, message, self.ask_timeout_s)

    def _rebuild(self) -> None:
        self.ledger.count("faults injected", detail="Rebuild")
        self._ask(Rebuild("xlog-actors chaos"))
        self.rebuilds += 1

    def generation(self) -> int:
        """The device's generation now.

        Returns:
            ``GetStats().generation``.
        Raises:
            XlogError, Lost: from the ask.
        Thread rule: this thread, or the main thread once this one ended.
        """
        value: int = self._ask(GetStats()).generation
        return value


class InProcessFaults(FaultInjector):
    """Faults of the in-process device: ``Rebuild``; on the host driver also planted driver faults.

    Thread rule: as ``FaultInjector``.
    """

    def __init__(self, name: str, device: pykka.ActorRef[Any], ledger: Ledger, seed: int, every_s: float,
                 ask_timeout_s: float, driver: Any) -> None:
        """Args:
            name, device, ledger, seed, every_s, ask_timeout_s: as ``FaultInjector``.
            driver: the device's driver (faults are planted only in a ``HostDriver``).
        """
        super().__init__(name, device, ledger, seed, every_s, ask_timeout_s)
        self.driver = driver
        self.planted = 0
        host = isinstance(driver, HostDriver)
        self.kinds = ("rebuild", "context_lost", "context_lost", "error", "oom") if host else ("rebuild",)

    def inject(self, kind: str) -> None:
        """See ``FaultInjector.inject``.

        Thread rule: this thread.
        """
        if kind == "rebuild":
            self._rebuild()
            return
        self.driver.inject_fault(0, kind, after_calls=self.rng.randint(0, 40))
        self.planted += 1
        self.ledger.count("faults injected", detail=f"inject_fault {kind!r}")


class IsolatedFaults(FaultInjector):
    """Faults of the isolated device: sticky errors and ``SIGKILL``\\ s of its processes, ``Rebuild``.

    Thread rule: as ``FaultInjector``; ``seen`` is read by the main thread after ``join``.
    """

    def __init__(self, name: str, device: pykka.ActorRef[Any], ledger: Ledger, seed: int, every_s: float,
                 ask_timeout_s: float, driver_kind: str, workers: list[int],
                 notice: Callable[[], None]) -> None:
        """Args:
            name, device, ledger, seed, every_s, ask_timeout_s: as ``FaultInjector``.
            driver_kind: ``"host"`` or ``"cuda"`` (which sticky fault the device process can meet).
            workers: the worker processes' pids (never killed).
            notice: called to record the device processes alive now (the main thread does too).
        """
        super().__init__(name, device, ledger, seed, every_s, ask_timeout_s)
        self.sticky = "sticky" if driver_kind == "host" else "illegal_address"
        self.workers = workers
        self.notice = notice
        self.deaths = 0
        self.reserves_killed = 0
        self.kinds = ("sticky", "kill", "kill reserve", "kill both", "rebuild")

    def serving_pid(self) -> int:
        """The pid of the process that serves the device now.

        Returns:
            ``ChildTimeline()["pid"]``.
        Raises:
            XlogError, Lost: from the ask.
        Thread rule: this thread, or the main thread.
        """
        pid: int = self._ask(ChildTimeline())["pid"]
        return pid

    def inject(self, kind: str) -> None:
        """See ``FaultInjector.inject``.

        Thread rule: this thread.
        """
        self.notice()
        if kind == "rebuild":
            self._rebuild()
            return
        before = self.generation()
        serving = self.serving_pid()
        if kind in ("kill reserve", "kill both"):
            reserves = sorted(device_processes(self.workers) - {serving})
            if not reserves or not self._kill(self.rng.choice(reserves)):
                self.ledger.count("faults skipped", detail=f"{kind}: no reserve process up")
                return
            self.reserves_killed += 1
            if kind == "kill reserve":
                self.ledger.count("faults injected", detail="SIGKILL of the reserve process")
                return
        if kind == "sticky":
            self.ledger.count("faults injected", detail=f"sticky error (ChildFault {self.sticky!r})")
            self.deaths += 1
            try:
                self._ask(ChildFault(self.sticky))  # type: ignore[arg-type]  # one of the kinds
            except XlogError:
                pass  # GpuRefStale("context poisoned") is the expected answer; counted
        elif self._kill(serving):
            self.deaths += 1
            self.ledger.count("faults injected", detail="SIGKILL of the serving process" if kind == "kill"
                              else "SIGKILL of the reserve, then of the serving process")
        else:
            self.ledger.count("faults skipped", detail=f"{kind}: the serving process was gone")
            return
        self._await_restart(before, kind)

    @staticmethod
    def _kill(pid: int) -> bool:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    def _await_restart(self, before: int, kind: str) -> None:
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if self.generation() > before:
                    self.notice()
                    return
            except XlogError:
                pass  # counted; the device may still be between processes
            time.sleep(0.05)
        self.ledger.broke("restarts", f"after a {kind}, no process served a generation past {before} "
                                      f"within {RESTART_TIMEOUT_S:.0f} s")
