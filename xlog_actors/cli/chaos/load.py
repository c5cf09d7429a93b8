"""The load of a chaos run: threads that each drive one device at random through its actor, two
copy actors and a kernel actor, and send handles to the worker processes.

Each thread keeps a few handles of its own, with the bytes each is known to hold (None when not
known: fresh, or a write that failed). Its steps, chosen by its own seeded generator:

* **allocate** (``Allocate``, or ``AllocateMany`` of 2-3 sizes), **free** (``Free``; then the
  handle must no longer validate), **drop** (the last reference goes; the device frees it);
* **copy**: write random bytes, fill, read back (compared with the known bytes), or copy one
  handle into another (``CopyToDevice``, ``Fill``, ``CopyToHost``, ``CopyDeviceToDevice``);
* **launch**: ``FILL_F32`` over a handle through the ``KernelActor``;
* **batch**: copy in on one copy actor, ``SCALE_ADD_F32`` on the kernel actor, copy back on the
  other; a batch whose three steps were answered without an error must equal numpy's result;
* **send**: pickle a handle of known bytes to a worker process (see :mod:`.workers`).

A handle found stale (``access()`` raises ``GpuRefStale``) is used once more on purpose: the step
must be refused with ``GpuRefStale``; then it is dropped. Thread rule: each ``LoadThread`` is its
own thread; nothing here is shared between them but the ledger and the worker pool.
"""

from __future__ import annotations

import pickle
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pykka

from ... import (
    Allocate,
    AllocateMany,
    AllocTag,
    CopyDeviceToDevice,
    CopyToDevice,
    CopyToHost,
    Fill,
    Free,
    GpuRef,
    In,
    Launch,
    Out,
)
from ...errors import GpuRefStale, XlogError
from ...kernels import FILL_F32, SCALE_ADD_F32, launch_shape
from .ledger import Ledger, Lost, Watch, ask, call
from .workers import WorkerPool, digest

__all__ = ["ASK_TIMEOUT_S", "EXPORT_TIMEOUT_S", "Held", "LoadThread", "Target", "copy_back"]

#: Every ask's bound: generous for a loaded 2-core machine where a device process restarts.
ASK_TIMEOUT_S = 30.0
#: Pickling a handle of an isolated device asks its process to export it (bounded at 30 s there).
EXPORT_TIMEOUT_S = 30.0
#: Handle sizes (bytes; multiples of 256, so of 4: every handle can hold float32 values).
SIZES = (256, 1024, 4096, 16384, 65536, 262144)
#: float32 values per batch.
BATCH_ELEMENTS = (64, 1000, 16384, 65536)
#: Exactly representable as float32, so numpy and the device compute the same thing.
SCALARS = (-2.0, -0.5, 0.0, 0.75, 1.0, 3.0)
#: The most handles one thread holds.
MAX_HELD = 6
#: Weights of the steps.
STEPS = {"allocate": 20, "free": 8, "drop": 8, "copy": 24, "launch": 10, "batch": 14, "send": 10}
#: The longest pause between two steps (lets the device's own threads in on 2 cores).
PAUSE_S = 0.002
TAG = AllocTag("chaos")
BATCH_TAG = AllocTag("chaos-batch")


@dataclass(frozen=True)
class Target:
    """One device under load: its actor and library actors, and where its verdicts go.

    Thread rule: immutable; any thread.
    """

    name: str
    device: pykka.ActorRef[Any]
    copiers: tuple[pykka.ActorRef[Any], ...]
    kernels: pykka.ActorRef[Any]
    ledger: Ledger


@dataclass(eq=False)
class Held:
    """A handle a thread holds, and the bytes it is known to hold (None: not known). Compared by
    identity.

    Thread rule: the holding thread only.
    """

    ref: GpuRef
    expected: bytes | None = None


def copy_back(asker: Callable[[pykka.ActorRef[Any], Any], Any], copier: pykka.ActorRef[Any], ref: GpuRef) -> bytes:
    """Read a batch's result back (``CopyToHost`` of all of ``ref``).

    A seam of its own so that a test can corrupt a batch on its way back and see the run say so.

    Args:
        asker: asks an actor a message, classifying the answer.
        copier: the copy actor.
        ref: the batch's output handle.
    Returns:
        The bytes.
    Raises:
        XlogError: the copy's typed error.
        Lost: an answer that broke an invariant.
    Thread rule: a load thread.
    """
    data: bytes = asker(copier, CopyToHost(ref))
    return data


def _first_difference(got: bytes, want: bytes) -> str:
    if len(got) != len(want):
        return f"{len(got)} bytes came back, {len(want)} expected"
    index = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    wrong = sum(a != b for a, b in zip(got, want, strict=True))
    return (f"{wrong} of {len(want)} bytes differ, the first at offset {index} "
            f"({got[index]:#04x}, expected {want[index]:#04x})")


class LoadThread(threading.Thread):
    """One of the run's load threads; see the module docstring.

    Thread rule: ``start``/``join`` from the run's main thread; the rest runs on this thread,
    except ``watch`` (any thread reads it) and ``release`` (called after the thread ended).
    """

    def __init__(self, index: int, target: Target, seed: int, workers: WorkerPool | None,
                 stop: threading.Event) -> None:
        """Args:
            index: the thread's number.
            target: the device it drives.
            seed: its generator's seed.
            workers: where handles are sent (None: no sends).
            stop: set when the load ends.
        """
        super().__init__(name=f"xlog-chaos-{target.name}-{index}", daemon=True)
        self.target = target
        self.ledger = target.ledger
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self.workers = workers
        self.stop_event = stop
        self.watch = Watch(self.name)
        self.held: list[Held] = []
        steps = dict(STEPS) if workers is not None and workers.count else {**STEPS, "send": 0}
        self._steps = list(steps)
        self._weights = list(steps.values())

    def run(self) -> None:
        """Take random steps until told to stop.

        Thread rule: this thread.
        """
        try:
            while not self.stop_event.is_set():
                step = self.rng.choices(self._steps, self._weights)[0]
                try:
                    getattr(self, f"_{step}")()
                except (XlogError, Lost):
                    pass  # recorded where it was answered
                self.stop_event.wait(self.rng.uniform(0, PAUSE_S))
        except Exception as exc:  # noqa: BLE001 - a step that raised what no ask raises: recorded
            self.ledger.broke("answered", f"{self.name} ended on {type(exc).__name__}: {exc}")

    def release(self) -> None:
        """Drop every handle the thread holds (after it ended).

        Thread rule: the run's main thread, after ``join``.
        """
        self.held.clear()

    # -- asking -------------------------------------------------------------------------------
    def _ask(self, actor: pykka.ActorRef[Any], message: Any) -> Any:
        return ask(self.ledger, self.watch, actor, message, ASK_TIMEOUT_S)

    def _pick(self) -> tuple[Held, str | None] | None:
        """A random handle held, and its stale reason if it is already stale (else None)."""
        if not self.held:
            return None
        held = self.rng.choice(self.held)
        try:
            held.ref.access()
        except GpuRefStale as exc:
            return held, exc.reason
        return held, None

    def _use(self, holds: list[tuple[Held, str | None]], actor: pykka.ActorRef[Any], message: Any) -> Any:
        """Ask ``actor`` a step on ``holds``. A handle already stale must not be served: the step
        is refused with a typed error (``GpuRefStale``, or an error about the device met first,
        such as the ``ContextLost`` of a context being rebuilt)."""
        stale = [(h, reason) for h, reason in holds if reason is not None]
        try:
            value = self._ask(actor, message)
        except XlogError as exc:
            if isinstance(exc, GpuRefStale) or stale:
                for h, _ in holds if isinstance(exc, GpuRefStale) else stale:
                    self._forget(h)
                self.ledger.count("stale handles refused", detail=type(exc).__name__)
            if stale:
                self.ledger.passed("stale")
            raise
        if stale:
            self.ledger.broke("stale", f"{type(message).__name__} on a handle already stale ({stale[0][1]}) "
                                       "was served")
            for h, _ in stale:
                self._forget(h)
            raise Lost
        return value

    def _forget(self, held: Held) -> None:
        if held in self.held:
            self.held.remove(held)

    # -- the steps ----------------------------------------------------------------------------
    def _allocate(self) -> None:
        if len(self.held) >= MAX_HELD:
            self._drop()
        if self.rng.random() < 0.25:
            sizes = [self.rng.choice(SIZES) for _ in range(self.rng.randint(2, 3))]
            refs = self._ask(self.target.device, AllocateMany(sizes, tag=TAG))
        else:
            refs = [self._ask(self.target.device, Allocate(self.rng.choice(SIZES), tag=TAG))]
        self.held.extend(Held(ref) for ref in refs)

    def _free(self) -> None:
        picked = self._pick()
        if picked is None:
            return
        held, _ = picked
        self._forget(held)
        self._ask(self.target.device, Free(held.ref))  # a stale handle's Free is a no-op, by design
        try:
            held.ref.access()
        except GpuRefStale:
            self.ledger.passed("stale")
            return
        self.ledger.broke("stale", "a handle still validates after its Free was answered")

    def _drop(self) -> None:
        if self.held:
            self.held.pop(self.rng.randrange(len(self.held)))

    def _copier(self) -> pykka.ActorRef[Any]:
        return self.rng.choice(self.target.copiers)

    def _copy(self) -> None:
        picked = self._pick()
        if picked is None:
            return
        held = picked[0]
        kind = self.rng.choice(("write", "fill", "read", "device"))
        nbytes = held.ref.nbytes
        if kind == "write":
            data = self.rng.randbytes(nbytes)
            held.expected = None
            self._use([picked], self._copier(), CopyToDevice(held.ref, data))
            held.expected = data
        elif kind == "fill":
            byte = self.rng.randrange(256)
            held.expected = None
            self._use([picked], self._copier(), Fill(held.ref, byte))
            held.expected = bytes([byte]) * nbytes
        elif kind == "read":
            got = self._use([picked], self._copier(), CopyToHost(held.ref))
            if held.expected is not None:
                if got == held.expected:
                    self.ledger.passed("reads")
                else:
                    self.ledger.broke("reads", f"CopyToHost of a {nbytes}-byte handle: "
                                               f"{_first_difference(got, held.expected)}")
        else:
            other = self._pick()
            if other is None or other[0] is held:
                return
            src, dst = (picked, other) if nbytes <= other[0].ref.nbytes else (other, picked)
            before = dst[0].expected
            dst[0].expected = None
            self._use([src, dst], self._copier(), CopyDeviceToDevice(src[0].ref, dst[0].ref))
            known = src[0].expected
            n = src[0].ref.nbytes
            if known is not None and (n == dst[0].ref.nbytes or before is not None):
                dst[0].expected = known + (before[n:] if before is not None else b"")

    def _launch(self) -> None:
        picked = self._pick()
        if picked is None:
            return
        held = picked[0]
        n = held.ref.nbytes // 4
        value = self.rng.choice(SCALARS)
        grid, block = launch_shape(n)
        held.expected = None
        self._use([picked], self.target.kernels, Launch(FILL_F32, grid, block, [Out(held.ref), value, n]))
        held.expected = np.full(n, value, np.float32).tobytes()

    def _batch(self) -> None:
        n = self.rng.choice(BATCH_ELEMENTS)
        x, out = self._ask(self.target.device, AllocateMany([4 * n, 4 * n], tag=BATCH_TAG))
        data = self.np_rng.standard_normal(n, dtype=np.float32)
        alpha, beta = self.rng.choice(SCALARS), self.rng.choice(SCALARS)
        grid, block = launch_shape(n)
        copy_in, copy_out = self.rng.sample(self.target.copiers, 2) if len(self.target.copiers) > 1 else (
            self.target.copiers * 2)
        try:
            self._ask(copy_in, CopyToDevice(x, data))
            self._ask(self.target.kernels, Launch(SCALE_ADD_F32, grid, block, [Out(out), In(x), alpha, beta, n]))
            got = copy_back(self._ask, copy_out, out)
        except XlogError as exc:
            self.ledger.count("batches ended by a typed error", detail=type(exc).__name__)
            raise
        want = np.multiply(data, np.float32(alpha))
        np.add(want, np.float32(beta), out=want)
        expected = want.tobytes()
        if got == expected:
            self.ledger.passed("batches")
            self.ledger.count("batches verified")
        else:
            self.ledger.broke("batches", f"batch of {n} floats (alpha {alpha}, beta {beta}): "
                                         f"{_first_difference(got, expected)}")
        if len(self.held) + 2 <= MAX_HELD:
            self.held += [Held(x, data.tobytes()), Held(out, expected)]

    def _send(self) -> None:
        known = [h for h in self.held if h.expected is not None]
        if not known or self.workers is None:
            return
        held = self.rng.choice(known)
        try:
            held.ref.access()
            reason = None
        except GpuRefStale as exc:
            reason = exc.reason
        expected = held.expected
        assert expected is not None
        try:
            blob = call(self.ledger, self.watch, "pickle (export)", EXPORT_TIMEOUT_S, lambda: pickle.dumps(held.ref))
        except XlogError as exc:
            if isinstance(exc, GpuRefStale) or reason is not None:
                self._forget(held)
                self.ledger.count("stale handles refused", detail=f"{type(exc).__name__} (pickling)")
            if reason is not None:
                self.ledger.passed("stale")
            raise
        self._forget(held)  # its bytes must not change while a worker reads them
        if reason is not None:
            self.ledger.broke("stale", f"a handle already stale ({reason}) was exported")
        keep = held.ref if self.rng.random() < 0.5 else None  # else its export alone keeps it alive
        self.workers.send(self.ledger, blob, digest(expected), len(expected), keep, self.rng.random())
