"""``xlog-actors chaos``: faults, kills and restarts under load, with every invariant checked.

One device is driven from ``--threads`` threads (8) and ``--workers`` worker processes (2), first
in process for half of ``--seconds``, then isolated in its own process for the other half (one
after the other, so that each column of the table belongs to one device): random allocations,
frees, drops, copies, kernels, batches and handles pickled to the workers, with a fault every few
seconds (:mod:`.faults`). Every answer is classified as it comes (:mod:`.ledger`); at each
device's end what it must give back is checked, and at the run's end what the run must not leave
behind. The table (:mod:`.table`) goes to stdout, progress and broken invariants as they happen
to stderr. Exit status 0 when every invariant held, 1 when one broke.

Modules: :mod:`.ledger` (the invariants and their bookkeeping), :mod:`.load` (the load threads),
:mod:`.workers` (the worker processes), :mod:`.faults` (the injectors), :mod:`.phase` (one
device's part), :mod:`.leftovers` (segments, processes, threads), :mod:`.table` (the output).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import sys
import threading
from collections.abc import Iterator

from ...errors import XlogError
from ..driver_choice import choose_driver
from ..options import UsageError
from .ledger import Ledger
from .leftovers import check_leftovers
from .phase import PHASES, ChaosConfig, DevicePhase
from .table import broken_rows, render
from .workers import WorkerPool

__all__ = ["ChaosConfig", "run_chaos", "run_devices"]

#: Bounds of the flags beyond their types.
MAX_THREADS = 64
MAX_WORKERS = 8


class _LogTally(logging.Handler):
    """Counts the runtime's log records of this process (warnings and up) and keeps the first
    few of each level."""

    KEPT = 3

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.by_level: dict[int, int] = {}
        self.first: dict[int, list[str]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.by_level[record.levelno] = self.by_level.get(record.levelno, 0) + 1
        kept = self.first.setdefault(record.levelno, [])
        if len(kept) < self.KEPT:
            kept.append(f"{record.levelname} {record.name}: {' '.join(record.getMessage().split())[:300]}")

    def lines(self) -> list[str]:
        if not self.by_level:
            return ["", "runtime log (this process): nothing at warning level or above"]
        levels = sorted(self.by_level, reverse=True)
        counts = ", ".join(f"{self.by_level[lv]} {logging.getLevelName(lv).lower()}" for lv in levels)
        firsts = [f"  {line}" for lv in levels for line in self.first[lv]]
        return ["", f"runtime log (this process): {counts}; the first of each:", *firsts]


@contextlib.contextmanager
def _tallied_logs() -> Iterator[_LogTally]:
    """The runtime's own log (``xlog_actors``, ``pykka``) counted instead of printed, for the run."""
    tally = _LogTally()
    loggers = [logging.getLogger(name) for name in ("xlog_actors", "pykka")]
    saved = [(lg.propagate, lg.level) for lg in loggers]
    for lg in loggers:
        lg.addHandler(tally)
        lg.propagate = False
        if lg.level == logging.NOTSET or lg.level > logging.WARNING:
            lg.setLevel(logging.WARNING)
    try:
        yield tally
    finally:
        for lg, (propagate, level) in zip(loggers, saved, strict=True):
            lg.removeHandler(tally)
            lg.propagate = propagate
            lg.setLevel(level)


def _check(args: argparse.Namespace) -> None:
    if args.threads > MAX_THREADS:
        raise UsageError(f"--threads {args.threads}: expected an integer from 1 to {MAX_THREADS}")
    if args.workers > MAX_WORKERS:
        raise UsageError(f"--workers {args.workers}: expected an integer from 0 to {MAX_WORKERS}")


def _config(args: argparse.Namespace, driver: str) -> ChaosConfig:
    devices = PHASES if args.devices == "both" else (args.devices,)
    return ChaosConfig(args.seconds, args.seed, args.threads, args.workers, args.fault_every, devices, driver)


def run_devices(config: ChaosConfig) -> list[Ledger]:
    """The run itself: the workers, each device in turn, the end-of-run checks.

    Args:
        config: what to run.
    Returns:
        The ledgers: one per device of ``PHASES`` (a device not run is marked so), then the end of
        the run.
    Raises:
        XlogError: a device could not be started.
        RuntimeError: a worker process did not start.
    Thread rule: the process's main thread (it spawns processes and starts threads).
    """
    ledgers = {name: Ledger(name) for name in PHASES}
    end = Ledger("end of run")
    end.ran = True
    before = set(threading.enumerate())
    workers = WorkerPool(config.workers, config.seed, cuda=config.driver == "cuda") if config.workers else None
    try:
        if workers is not None:
            workers.start()
        for name in config.devices:
            DevicePhase(name, config, workers, ledgers[name]).run()
    finally:
        if workers is not None:
            workers.close(end)
    worker_pids = workers.pids if workers is not None else []
    check_leftovers(end, processes=worker_pids, workers=[], segment_owners={os.getpid(), *worker_pids},
                    threads_before=before)
    return [*ledgers.values(), end]


def run_chaos(args: argparse.Namespace) -> int:
    """Run ``xlog-actors chaos`` as the parsed flags say and print its table.

    Args:
        args: the parsed ``chaos`` flags.
    Returns:
        0 when every invariant held, 1 when one broke (or the run could not start).
    Raises:
        UsageError: a flag out of its range, or a bad ``XLOG_ACTORS_DRIVER``.
        NoGpu: ``cuda`` asked for where no GPU is usable.
    Thread rule: the process's main thread.
    """
    _check(args)
    # A crash of the process (a fault in native code) must leave every thread's stack behind:
    # it is a broken run like any other, and its place is what the run is for.
    if not faulthandler.is_enabled():
        faulthandler.enable(file=sys.stderr, all_threads=True)
    choice = choose_driver(args.driver)
    kind = choice.driver.kind
    choice.driver.close()  # each device opens its own (shared memory, an IPC-capable pool)
    config = _config(args, kind)
    how = (f"in process for {config.seconds_each:g} s, then isolated for {config.seconds_each:g} s "
           "(one after the other)" if len(config.devices) == 2
           else f"{config.devices[0]} for {config.seconds_each:g} s")
    print(f"xlog-actors chaos: {choice.describe()}", file=sys.stderr)
    print(f"xlog-actors chaos: device 0 {how}; {config.threads} threads, {config.workers} worker processes, "
          f"a fault every ~{config.fault_every:g} s; seed {config.seed}", file=sys.stderr, flush=True)
    with _tallied_logs() as tally:
        try:
            ledgers = run_devices(config)
        except (XlogError, RuntimeError) as exc:
            print(f"xlog-actors chaos: error: the run could not start: {type(exc).__name__}: "
                  f"{' '.join(str(exc).split())}", file=sys.stderr)
            return 1
    print(render(ledgers, tally.lines()))
    return 1 if broken_rows(ledgers) else 0
