"""The chaos run's worker processes: handles pickled to them, opened, read, checked, sometimes
forwarded to the other worker, released; and the parent's side that sends and collects.

A message carries one pickled ``GpuRef`` (or a worker's ``SharedGpuRef`` forwarded once) and the
digest of the bytes the handle held when it was pickled. The worker puts some messages aside,
still pickled, for up to 2 s (so that handles pickled before a restart of their device are
unpickled after it), then unpickles each (a failure is a
**lost message**: the handle did not arrive), waits for its last write and reads it (``view()``
on the host driver, ``cuMemcpyDtoH`` on the GPU), checks it is still valid, compares the digest,
and answers one of ``ok``, ``bad bytes``, ``stale`` (``GpuRefStale``: an acceptable answer),
``typed`` (another ``XlogError``), ``untyped`` or ``lost``. Every message must be answered within
:data:`MESSAGE_TIMEOUT_S`.

Workers are spawned (never forked), live for the whole run (both devices), and end when told or
when their parent is gone.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import pickle
import queue
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from ...errors import GpuRefStale, XlogError
from .ledger import Ledger

__all__ = ["MESSAGE_TIMEOUT_S", "WorkerPool", "digest", "worker_main"]

#: How long a worker may take to answer a message (it waits up to 30 s for a write itself).
MESSAGE_TIMEOUT_S = 60.0
#: How long a worker may take to start (spawn and import) and to end when told.
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
#: The chance that a worker forwards a handle it checked to the other worker.
FORWARD_P = 0.3
#: The chance that a worker puts a message aside, still pickled, for a while (``HOLD_S``), so
#: that some handles cross a restart of their device before they are unpickled.
HOLD_P = 0.15
HOLD_S = (0.2, 2.0)
#: How long a worker waits for a handle's exported write.
WRITE_TIMEOUT_S = 30.0


def digest(data: bytes | bytearray | memoryview) -> bytes:
    """The digest a message carries of a handle's bytes.

    Args:
        data: the bytes.
    Returns:
        16 bytes of BLAKE2b.
    Thread rule: any thread.
    """
    return hashlib.blake2b(data, digest_size=16).digest()


def _read(handle: Any, nbytes: int) -> bytes:
    """The bytes of an imported handle, after its exported last write (as
    ``examples/worker_pool.py`` reads them)."""
    if handle.export.driver == "host":
        return bytes(handle.view(timeout_s=WRITE_TIMEOUT_S)[:nbytes])
    import numpy as np
    from cuda.bindings import driver as cu  # the GPU only: cuda-python is there

    handle.wait_write(timeout_s=WRITE_TIMEOUT_S)
    out = np.empty(nbytes, np.uint8)
    (err,) = cu.cuMemcpyDtoH(out, handle.raw_device_ptr(), nbytes)  # the context current: raw_device_ptr's
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemcpyDtoH failed: {err}")
    return out.tobytes()


def _serve(task: tuple[Any, ...], rng: random.Random, peer: Any, outbox: Any) -> tuple[str, str]:
    """Check one message; forward it to ``peer`` sometimes. Returns (outcome, detail)."""
    _, msg_id, blob, expected, nbytes, hops = task
    try:
        handle = pickle.loads(blob)
    except BaseException as exc:  # noqa: BLE001 - whatever it is, the message is lost
        return "lost", f"unpickling raised {type(exc).__name__}: {exc}"
    try:
        data = _read(handle, nbytes)
        handle.access()  # still valid after the read: the bytes are the exported ones
        if digest(data) != expected:
            return "bad bytes", f"a {nbytes}-byte handle read in process {os.getpid()} does not match its digest"
        if peer is not None and hops == 0 and rng.random() < FORWARD_P:
            forwarded = pickle.dumps(handle)  # the importer forwards it: a count of its own
            outbox.put(("forwarded", msg_id, f"{msg_id}f"))
            peer.put(("task", f"{msg_id}f", forwarded, expected, nbytes, 1))
        return "ok", ""
    except GpuRefStale as exc:
        return "stale", exc.reason
    except XlogError as exc:
        return "typed", f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported to the parent as a broken invariant
        return "untyped", f"{type(exc).__name__}: {exc}"
    finally:
        handle.release()
        del handle


def worker_main(index: int, inbox: Any, peer: Any, outbox: Any, seed: int, cuda: bool = False) -> None:
    """A worker process's body: serve messages from ``inbox`` until ``None`` or the parent is gone.

    Args:
        index: the worker's number.
        inbox: its ``multiprocessing`` queue of messages.
        peer: the other worker's queue (None when alone): forwarded handles go there.
        outbox: the queue of answers to the parent.
        seed: its random choices' seed.
        cuda: the handles are of a GPU: the device's primary context is made here before the
            worker answers its first ping (its first import would make it anyway, and keep it
            for the process's life), so a device's idle memory reading, taken after every worker
            answered, already counts the workers' contexts.
    Thread rule: the process's main thread.
    """
    if cuda:
        from ...driver.cuda.importer import make_current

        make_current(0)
    parent = os.getppid()
    rng = random.Random(seed)
    held: list[tuple[float, tuple[Any, ...]]] = []  # (not before, task): put aside, still pickled
    while True:
        now = time.monotonic()
        due = [entry for entry in held if entry[0] <= now]
        for entry in due:
            held.remove(entry)
            outcome, detail = _serve(entry[1], rng, peer, outbox)
            outbox.put(("result", entry[1][1], outcome, detail))
        try:
            task = inbox.get(timeout=0.05 if held else 1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return  # orphaned: nobody will ask again
            continue
        if task is None:
            break
        if task[0] == "ping":
            outbox.put(("pong", index, os.getpid()))
            continue
        if rng.random() < HOLD_P:
            held.append((time.monotonic() + rng.uniform(*HOLD_S), task))
            continue
        outcome, detail = _serve(task, rng, peer, outbox)
        outbox.put(("result", task[1], outcome, detail))
    for _, task in held:  # told to end: what was put aside is answered first
        outcome, detail = _serve(task, rng, peer, outbox)
        outbox.put(("result", task[1], outcome, detail))
    outbox.close()
    outbox.join_thread()
    if peer is not None:
        peer.close()
        peer.join_thread()


@dataclass
class _Message:
    ledger: Ledger
    deadline: float
    keep: Any  # the sender's GpuRef, kept alive until answered (or None: dropped at once)
    reported: bool = False


class WorkerPool:
    """The parent's side: spawns the workers, sends them handles, collects their answers on a
    thread of its own and records each in the sending device's ledger.

    Thread rule: ``send`` from any thread; ``start``, ``check_overdue``, ``drain`` and ``close``
    from the run's main thread.
    """

    def __init__(self, count: int, seed: int, cuda: bool = False) -> None:
        """Args:
            count: how many workers (0: none; ``send`` then refuses).
            seed: the workers' seeds derive from it.
            cuda: the handles are of a GPU (see :func:`worker_main`).
        """
        self.count = count
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA
        self._outbox: Any = ctx.Queue()
        self._inboxes: list[Any] = [ctx.Queue() for _ in range(count)]
        self._procs = [
            ctx.Process(
                target=worker_main,
                args=(i, self._inboxes[i], self._inboxes[(i + 1) % count] if count > 1 else None, self._outbox,
                      seed * 1000 + i, cuda),
                name=f"xlog-chaos-worker-{i}", daemon=True,
            )
            for i in range(count)
        ]
        self._lock = threading.Lock()
        self._pending: dict[str, _Message] = {}
        self._early: dict[str, tuple[str, str]] = {}
        self._serial = 0
        self._ready: set[int] = set()
        self._stop = threading.Event()
        self._collector = threading.Thread(target=self._collect, name="xlog-chaos-collector", daemon=True)
        self.pids: list[int] = []

    def start(self) -> None:
        """Start the workers and wait until each answers (its queues and threads are then up).

        Raises:
            RuntimeError: a worker did not start within ``START_TIMEOUT_S``.
        Thread rule: the run's main thread.
        """
        for proc in self._procs:
            proc.start()
        self.pids = [proc.pid for proc in self._procs if proc.pid is not None]
        self._collector.start()
        for box in self._inboxes:
            box.put(("ping",))
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(self._ready) < self.count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(self._ready)} of {self.count} worker processes started "
                                   f"within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def send(self, ledger: Ledger, blob: bytes, expected: bytes, nbytes: int, keep: Any, pick: float) -> None:
        """Send one pickled handle to a worker.

        Args:
            ledger: the sending device's ledger (the answer is recorded there).
            blob: the pickled handle.
            expected: the digest of its bytes.
            nbytes: how many bytes to read.
            keep: the sender's handle, kept until the answer (None: not kept).
            pick: a number in [0, 1) choosing the worker.
        Thread rule: any thread.
        """
        with self._lock:
            self._serial += 1
            msg_id = str(self._serial)
            self._pending[msg_id] = _Message(ledger, time.monotonic() + MESSAGE_TIMEOUT_S, keep)
        ledger.count("handles sent to workers")
        self._inboxes[int(pick * self.count)].put(("task", msg_id, blob, expected, nbytes, 0))

    def _collect(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._outbox.get(timeout=0.2)
            except queue.Empty:
                continue
            except (EOFError, OSError):
                return
            if item[0] == "pong":
                self._ready.add(item[1])
            elif item[0] == "forwarded":
                self._forwarded(item[1], item[2])
            else:
                self._answered(item[1], item[2], item[3])

    def _forwarded(self, msg_id: str, new_id: str) -> None:
        with self._lock:
            origin = self._pending.get(msg_id)
            if origin is None:
                return
            self._pending[new_id] = _Message(origin.ledger, time.monotonic() + MESSAGE_TIMEOUT_S, None)
            early = self._early.pop(new_id, None)
        origin.ledger.count("handles forwarded between workers")
        if early is not None:
            self._answered(new_id, *early)

    def _answered(self, msg_id: str, outcome: str, detail: str) -> None:
        with self._lock:
            message = self._pending.pop(msg_id, None)
            if message is None:
                self._early[msg_id] = (outcome, detail)  # its forwarding was not announced yet
                return
        ledger = message.ledger
        ledger.count("worker answers", detail=outcome)
        if message.reported:
            return  # already reported late; its answer is still counted
        if outcome == "lost":
            ledger.broke("arrived", f"a handle sent to a worker did not arrive: {detail}")
            return
        ledger.passed("arrived")
        if outcome == "ok":
            ledger.passed("reads")
        elif outcome == "bad bytes":
            ledger.broke("reads", detail)
        elif outcome == "stale":
            ledger.count("stale handles refused", detail="GpuRefStale (in a worker)")
        elif outcome == "untyped":
            ledger.broke("answered", f"a worker's read raised an untyped error: {detail}")

    def check_overdue(self) -> None:
        """Record each message past its deadline as broken (once; it may still be answered).

        Thread rule: the run's main thread.
        """
        now = time.monotonic()
        with self._lock:
            late = [(k, m) for k, m in self._pending.items() if not m.reported and now > m.deadline]
            for _, message in late:
                message.reported = True
        for msg_id, message in late:
            message.ledger.broke("arrived", f"message {msg_id}: no answer from a worker within "
                                            f"{MESSAGE_TIMEOUT_S:.0f} s")

    def drain(self, ledger: Ledger, timeout_s: float) -> int:
        """Wait until every message ``ledger`` sent is answered or overdue; drop the handles kept.

        Args:
            ledger: whose messages.
            timeout_s: the longest wait.
        Returns:
            How many are still unanswered (each recorded as broken).
        Thread rule: the run's main thread.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_overdue()
            with self._lock:
                mine = {k: m for k, m in self._pending.items() if m.ledger is ledger}
                if not mine or time.monotonic() > deadline:
                    for k in mine:
                        del self._pending[k]
                    break
            time.sleep(0.05)
        for msg_id, message in mine.items():
            if not message.reported:
                ledger.broke("arrived", f"message {msg_id}: still unanswered when the device's load ended")
        return len(mine)

    def close(self, ledger: Ledger) -> None:
        """Tell the workers to end, join them with a deadline (killing one that hangs), stop the
        collector and close the queues; record what went wrong in ``ledger``.

        Args:
            ledger: the end-of-run ledger.
        Thread rule: the run's main thread.
        """
        for box in self._inboxes:
            box.put(None)
        for proc in self._procs:
            if proc.pid is None:
                continue
            proc.join(STOP_TIMEOUT_S)
            if proc.is_alive():
                ledger.broke("hangs", f"worker process {proc.pid} did not end within {STOP_TIMEOUT_S:.0f} s "
                                      "of being told; killed")
                proc.kill()
                proc.join(STOP_TIMEOUT_S)
            elif proc.exitcode != 0:
                ledger.broke("processes", f"worker process {proc.pid} ended with exit code {proc.exitcode}")
            else:
                ledger.passed("hangs")
        self._stop.set()
        self._collector.join(STOP_TIMEOUT_S)
        if self._collector.is_alive():
            ledger.broke("hangs", "the answer collector thread did not end")
        for box in [*self._inboxes, self._outbox]:
            box.close()
            box.join_thread()
