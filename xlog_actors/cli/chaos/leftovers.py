"""What a chaos run must not leave behind: shared-memory segments of its processes, processes,
threads. Each check polls for a short while first, since the runtime ends some of them
asynchronously (a reader thread that sees its pipe close, a segment unlinked after a death).

What is still there after :data:`QUIET_S` is looked at again after a garbage collection: what a
collection removes (an object in a reference cycle that owns a segment or a thread) is not a
leftover, but it is counted (``left until a garbage collection``, by kind) so that it shows.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import re
import threading
import time
from collections.abc import Iterable

from .ledger import Ledger

__all__ = ["PROCESS_WIDE_THREADS", "SHM_DIR", "check_leftovers", "device_processes", "segments_of"]

SHM_DIR = "/dev/shm"
#: Threads the runtime keeps for the life of the process by design, by name prefix: the file
#: descriptor server of ``driver.fd_passing.served()`` (one per process; an IPC-capable pool's
#: exports start it on the GPU). Counted, not leftovers.
PROCESS_WIDE_THREADS = ("xlog-fd-server-",)
#: How long each check waits for things to go away by themselves, then after a collection.
QUIET_S = 2.0
SETTLE_S = 10.0


def _owner(name: str) -> int | None:
    """The pid in a segment name ``xlog-<what>-<pid>-...``, or None."""
    parts = name.split("-")
    return int(parts[2]) if len(parts) > 3 and parts[0] == "xlog" and parts[2].isdigit() else None


def segments_of(pids: Iterable[int]) -> list[str]:
    """The ``xlog-*`` shared-memory segments that processes ``pids`` created and that still exist.

    Args:
        pids: the owners to look for.
    Returns:
        Their names, sorted.
    Thread rule: any thread.
    """
    owners = set(pids)
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return sorted(n for n in names if _owner(n) in owners)


def _alive(pid: int) -> str | None:
    """None when ``pid`` is gone, else its state letter (``Z``: a zombie not reaped)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def device_processes(workers: Iterable[int]) -> set[int]:
    """This process's live ``multiprocessing`` children that are not the chaos workers: the
    device processes (serving and reserve) of an isolated device.

    Args:
        workers: the workers' pids.
    Returns:
        Their pids.
    Thread rule: any thread.
    """
    skip = set(workers)
    return {p.pid for p in multiprocessing.active_children() if p.pid is not None and p.pid not in skip}


def _kind(name: str) -> str:
    """A name without what is particular to this run (pids, tokens, serials)."""
    return re.sub(r"-?[0-9a-f]*[0-9][0-9a-f]*(?=-|$|\.)", "", name).replace("..", ".").strip("-.")


def check_leftovers(ledger: Ledger, *, processes: Iterable[int], workers: Iterable[int],
                    segment_owners: Iterable[int], threads_before: set[threading.Thread],
                    settle_s: float = SETTLE_S) -> None:
    """Record whether the part of the run just ended left processes, segments or threads.

    Waits ``QUIET_S`` for them to go by themselves, then collects garbage and waits up to
    ``settle_s`` more; what only a collection removed is counted (``left until a garbage
    collection``), what stays breaks its invariant.

    Args:
        ledger: where the verdicts go.
        processes: processes that must be gone (the device processes seen); besides, no child of
            this process but the workers may be alive.
        workers: the worker processes' pids (alive during the run).
        segment_owners: the processes whose ``xlog-*`` segments must all be gone.
        threads_before: the threads alive when the part began; every later one must have ended.
        settle_s: the longest wait after the collection.
    Thread rule: the run's main thread.
    """
    watched, skip, owners = set(processes), list(workers), set(segment_owners)

    def procs() -> list[str]:
        alive = {p for p in watched if _alive(p) is not None} | device_processes(skip)
        return [f"{p} ({_alive(p) or 'gone'})" for p in sorted(alive)]

    def threads() -> list[str]:
        return sorted(t.name for t in threading.enumerate() if t not in threads_before and t.is_alive()
                      and not t.name.startswith(PROCESS_WIDE_THREADS))

    for thread in threading.enumerate():
        if thread not in threads_before and thread.name.startswith(PROCESS_WIDE_THREADS):
            ledger.count("process-wide threads the runtime keeps", detail=_kind(thread.name))

    checks = {"processes": procs, "segments": lambda: segments_of(owners), "threads": threads}
    nouns = {"processes": "process", "segments": "segment", "threads": "thread"}
    quiet = time.monotonic() + min(QUIET_S, settle_s)
    while any(check() for check in checks.values()) and time.monotonic() < quiet:
        time.sleep(0.1)
    before = {key: check() for key, check in checks.items()}
    if any(before.values()):
        gc.collect()
        deadline = time.monotonic() + settle_s
        while any(check() for check in checks.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
            gc.collect()
    for key, check in checks.items():
        left = check()
        for name in sorted(set(before[key]) - set(left)):
            ledger.count("left until a garbage collection", detail=f"{nouns[key]} {_kind(name)}")
        if not left:
            ledger.passed(key)
            continue
        shown = ", ".join(left[:6]) + (f" and {len(left) - 6} more" if len(left) > 6 else "")
        where = f" in {SHM_DIR}" if key == "segments" else ""
        ledger.broke(key, f"{len(left)} {nouns[key]}(es) left{where}: {shown}" if key == "processes"
                     else f"{len(left)} {nouns[key]}(s) left{where}: {shown}")
