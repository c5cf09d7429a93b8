"""The demo pipeline: copy in, kernel, copy out of consecutive batches at once, on the streams of
three library actors (a ``CopyActor`` in, a ``KernelActor``, a ``CopyActor`` out), over a ring of
``depth`` device buffer sets.

One thread orchestrates with pykka futures: it sends a batch's next stage as soon as the actor
has *enqueued* the stage before (that reply comes back at once; the device work goes on), and
waits for whichever reply comes first (every ask posts to one queue when answered:
``ask_notifying``), never for one batch while another has a stage to send. A batch is four
messages: its copy in, its two kernels as one ``Launches``, and the copies back of its output
and of its checksum. No code here synchronizes anything: the library actors' tracking orders
every stage after the one before it on another stream, and a ring buffer's reuse after its last
reader.

The inputs are built once, before timing starts (:class:`~.batches.BatchData`). Every batch is
verified exactly, off the critical path: the kernel actor launches ``CHECKSUM_U32`` over the output
after ``SCALE_ADD_F32``, adding into the slot's 8-byte running sum (zeroed once, when the slot is
allocated); those 8 bytes come back with the output, and what the batch added is compared with
the checksum computed once per distinct input. The first and the last batch are also compared
byte for byte with the host reference, so a checksum collision cannot hide a wrong result.

A stage that meets a stale handle (a ``Rebuild`` mid-run) reports it; the batch is run again on
newly allocated buffers.

Past 400 lines because one run is one concept: the ring, the batches in flight, their stale
retries and verification share one state, and the host-memory seams sit beside the one user.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pykka

from ..actors import CopyActor, DeviceActor, GpuRef, KernelActor
from ..actors.library_messages import CopyDone, CopyToDevice, CopyToHost, Fill, In, InOut, Launch, Launches, Out
from ..actors.messages import Allocate, AllocatePinned, GetStats, Rebuild
from ..actors.pykka_internals import ask_notifying
from ..driver.kernel_library import CHECKSUM_U32, SCALE_ADD_F32, launch_shape
from ..driver.protocol import Buffer, Driver
from ..errors import GpuRefStale, XlogError
from ..memory.block import AllocTag
from ..memory.pinned import PinnedBuffer
from .batches import ALPHA, BETA, BatchData

__all__ = ["PipelineConfig", "PipelineResult", "run_pipeline"]

_INPUT = AllocTag("demo-input")
_OUTPUT = AllocTag("demo-output")
_SUM_BYTES = 8
_POISON = 0xDD  # what the host driver writes over freed memory too


@dataclass
class PipelineConfig:
    """How a pipeline run is shaped. ``batches`` and ``depth`` must be at least 1 (the command
    line checks them), ``batch_bytes`` a positive multiple of 4, ``rebuild_at`` a batch index.

    Thread rule: build it, then hand it to :func:`run_pipeline`; not changed after.
    """

    batches: int = 32
    batch_bytes: int = 1 << 20
    depth: int = 4  # batches in flight at once: the ring's buffer sets
    track: bool = True  # False: library actors skip cross-stream tracking (to show the hazard)
    producer_delay_us: int = 0  # a spin before each input copy: a slow producer stream
    rebuild_at: int | None = None  # ask the device for a Rebuild when this batch is copied in
    timeout_s: float = 600.0


@dataclass
class PipelineResult:
    """What a pipeline run did: batches verified or mismatched, stale retries, errors, time.

    ``compared`` counts the batches also compared byte for byte with the host reference.

    Thread rule: any thread; built once by :func:`run_pipeline`.
    """

    batches: int
    batch_bytes: int
    verified: int
    mismatched: list[int]
    stale_retries: int
    errors: list[str]
    seconds: float
    generation: int
    driver: str
    device: str
    compared: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every batch verified, none mismatched, no error."""
        return self.verified == self.batches and not self.mismatched and not self.errors

    @property
    def throughput_bytes_s(self) -> float:
        """Input bytes through the whole pipeline per second."""
        return self.batches * self.batch_bytes / self.seconds if self.seconds > 0 else 0.0


# The host-memory seams: host buffers come from ``_host_buffer`` (viewed through ``_host_array``)
# and copies back go through ``_copy_back``/``_landed``. They are the only code that knows whether
# host memory is pinned; everything else holds the buffer objects they hand out.


def _host_buffer(device: pykka.ActorRef[Any], nbytes: int) -> PinnedBuffer:
    """A pinned host buffer of ``nbytes`` for inputs and copies back, allocated through the device
    (copies from and to it need no staging, and its memory outlives no copy that uses it)."""
    buffer: PinnedBuffer = device.ask(AllocatePinned(nbytes, tag=AllocTag("demo host")), block=True)
    return buffer


def _host_array(buffer: PinnedBuffer) -> np.ndarray:
    """``buffer`` (from ``_host_buffer``) as a uint8 numpy array over the same bytes."""
    return buffer.array(np.uint8)


def _copy_back(copy_out: pykka.ActorRef[Any], ref: GpuRef, nbytes: int, out: PinnedBuffer,
               replies: queue.SimpleQueue[Hashable]) -> Any:
    """Ask ``copy_out`` to copy ``nbytes`` of ``ref`` into ``out`` (a buffer from
    ``_host_buffer``); the future of its reply, a ``CopyDone`` once the copy is enqueued (its
    answer also posts to ``replies``)."""
    return ask_notifying(copy_out, CopyToHost(ref, nbytes, out=out), replies, "copy back")


def _landed(reply: CopyDone, out: PinnedBuffer) -> Buffer | None:
    """The bytes of a copy back (a view of ``out``) once they are on the host; None if they have
    not landed yet (never blocks)."""
    return out.array(np.uint8) if reply.done() else None


@dataclass
class _Slot:
    """One ring entry: the device buffers of a batch in flight and the host buffers it comes back to."""

    inp: GpuRef
    out: GpuRef
    sums: GpuRef
    host_out: PinnedBuffer  # from _host_buffer, as host_sums
    host_sums: PinnedBuffer
    total: int = 0  # the running checksum the device holds after the slot's last verified batch


@dataclass
class _Batch:
    """A batch in flight: its ring slot, its stage and the futures of that stage's replies."""

    index: int
    slot: int
    stage: int  # 0: copy in sent; 1: kernels sent; 2: copies back sent
    futures: list[Any]


_PENDING = object()
#: How long the orchestrator waits for a reply while a copy back is landing, before it looks at
#: the landed bytes again (a 16 MiB copy back takes about 0.3 ms on an H200).
_LANDING_POLL_S = 100e-6


def _outcome(future: Any, timeout: float) -> Any:
    """The future's value, the ``XlogError`` it failed with, or ``_PENDING``."""
    try:
        return future.get(timeout=timeout)
    except pykka.Timeout:
        return _PENDING
    except XlogError as exc:
        return exc


class _Run:
    """The orchestrating thread's state: the ring, the batches in flight, the tally."""

    def __init__(self, device: pykka.ActorRef[Any], actors: tuple[pykka.ActorRef[Any], ...], cfg: PipelineConfig,
                 data: BatchData, driver: Driver) -> None:
        self.device, (self.copy_in, self.kernels, self.copy_out) = device, actors
        self.cfg, self.data, self.driver = cfg, data, driver
        self.n = cfg.batch_bytes // 4
        self.shape = launch_shape(self.n)
        self.replies: queue.SimpleQueue[Hashable] = queue.SimpleQueue()  # a key per answered ask
        self.slots: list[_Slot | None] = [None] * cfg.depth
        self.free = deque(range(cfg.depth))
        self.todo = deque(range(cfg.batches))
        self.inflight: list[_Batch] = []
        self.rebuilt = False
        self.verified = 0
        self.mismatched: list[int] = []
        self.compared = 0
        self.stale_retries = 0
        self.errors: list[str] = []

    @property
    def done(self) -> int:
        """Batches verified or found wrong."""
        return self.verified + len(self.mismatched)

    def slot(self, s: int) -> _Slot:
        """Slot ``s``, allocated first if it has no buffers (at the start, after a stale handle)."""
        slot = self.slots[s]
        if slot is None:
            nbytes = self.cfg.batch_bytes
            inp: GpuRef = self.device.ask(Allocate(nbytes, tag=_INPUT), block=True)
            out: GpuRef = self.device.ask(Allocate(nbytes, tag=_OUTPUT), block=True)
            sums: GpuRef = self.device.ask(Allocate(_SUM_BYTES, tag=_OUTPUT), block=True)
            host_out = _host_buffer(self.device, nbytes)
            slot = self.slots[s] = _Slot(inp, out, sums, host_out, _host_buffer(self.device, _SUM_BYTES))
            self.copy_in.ask(Fill(sums, 0), block=True)  # tracked: the first checksum adds after it
            # Fresh pool memory may still hold an earlier run's batches at the same addresses
            # (a warm pool hands them out again in order): poisoned, a read that comes too early
            # (tracking off) sees bytes no batch has, instead of an earlier run's right answer.
            self.copy_in.ask(Fill(inp, _POISON), block=True)
            self.copy_in.ask(Fill(out, _POISON), block=True)
        return slot

    def warm_up(self) -> None:
        """Allocate the ring and compile and load the three kernels before timing (NVRTC compiles on
        the first launch)."""
        for s in range(self.cfg.depth):
            self.slot(s)
        slot = self.slot(0)
        for future in self._kernels(slot, 1):
            future.get()
        self.copy_in.ask(Fill(slot.sums, 0), block=True)

    def _kernels(self, slot: _Slot, n: int) -> list[Any]:
        grid, block = self.shape if n == self.n else launch_shape(n)
        launches = Launches((
            Launch(SCALE_ADD_F32, grid, block, [Out(slot.out), In(slot.inp), ALPHA, BETA, n]),
            Launch(CHECKSUM_U32, grid, block, [InOut(slot.sums), In(slot.out), n]),
        ))
        return [ask_notifying(self.kernels, launches, self.replies, "kernels")]

    def start(self, index: int, s: int) -> None:
        """Send batch ``index``'s copy in to slot ``s``."""
        slot = self.slot(s)
        if self.cfg.producer_delay_us:
            self._slow_producer(slot.inp)
        future = ask_notifying(self.copy_in, CopyToDevice(slot.inp, self.data.input(index)), self.replies, "copy in")
        self.inflight.append(_Batch(index, s, 0, [future]))
        if self.cfg.rebuild_at == index and not self.rebuilt:
            self.rebuilt = True
            _outcome(future, self.cfg.timeout_s)  # the copy is enqueued (or failed) before the rebuild
            try:
                self.device.ask(Rebuild("demo: rebuild mid-pipeline"))
            except XlogError as exc:
                self.errors.append(f"rebuild at batch {index}: {exc!r}")

    def _slow_producer(self, ref: GpuRef) -> None:
        # A spin on the copy actor's stream before the copy: what tracking must order after.
        stream_id = self.copy_in.proxy().stream_id.get()
        stream = ref.context.runtime.stream_pool.resolve(stream_id)
        if stream is not None:
            self.driver.sleep(stream, self.cfg.producer_delay_us)

    def advance(self, batch: _Batch) -> bool:
        """Move ``batch`` on if its stage's replies are in; never blocks. Returns whether it moved."""
        # A stage's requests all go to one actor, which answers in order: the last reply is the
        # one to look at first, which keeps the orchestrating thread's share of the GIL small.
        if _outcome(batch.futures[-1], 0) is _PENDING:
            return False
        results = [_outcome(f, 0) for f in batch.futures]
        if any(r is _PENDING for r in results):
            return False
        failed = [r for r in results if isinstance(r, XlogError)]
        if failed:
            self._failed(batch, failed[0])
            return True
        slot = self.slots[batch.slot]
        assert slot is not None
        if batch.stage == 0:
            batch.futures = self._kernels(slot, self.n)
        elif batch.stage == 1:
            batch.futures = [
                _copy_back(self.copy_out, slot.out, self.cfg.batch_bytes, slot.host_out, self.replies),
                _copy_back(self.copy_out, slot.sums, _SUM_BYTES, slot.host_sums, self.replies),
            ]
        else:
            output = _landed(results[0], slot.host_out)
            sums = None if output is None else _landed(results[1], slot.host_sums)
            if output is None or sums is None:
                return False
            self._verify(batch.index, slot, output, sums)
            self._retire(batch)
            return True
        batch.stage += 1
        return True

    def _verify(self, index: int, slot: _Slot, output: Buffer, sums: Buffer) -> None:
        # The slot's sum is never zeroed between batches (one launch fewer per batch): this batch's
        # checksum is what it added, modulo 2**64.
        total = int(np.frombuffer(memoryview(sums).cast("B"), dtype=np.uint64)[0])
        ok = (total - slot.total) % (1 << 64) == self.data.checksum(index)
        slot.total = total
        if ok and index in (0, self.cfg.batches - 1):
            self.compared += 1
            ok = self.data.matches(index, output)
        if ok:
            self.verified += 1
        else:
            self.mismatched.append(index)

    def _failed(self, batch: _Batch, exc: XlogError) -> None:
        """A stale handle (a rebuild happened) runs the batch again on new buffers; any other
        error ends the run."""
        self._retire(batch)
        if isinstance(exc, GpuRefStale):
            self.stale_retries += 1
            self.slots[batch.slot] = None
            self.todo.appendleft(batch.index)
        else:
            stage = ("copy in", "kernel", "copy out")[batch.stage]
            self.errors.append(f"{stage}, batch {batch.index}: {exc!r}")

    def _retire(self, batch: _Batch) -> None:
        self.inflight.remove(batch)
        self.free.append(batch.slot)

    def step(self, timeout: float) -> None:
        """Start what the ring has room for, move on every batch whose replies are in; if none
        moved, wait up to ``timeout`` s for the next reply, whichever batch it is for (or, while
        a copy back is in flight, a moment, then look at its bytes again)."""
        while self.free and self.todo and not self.errors:
            index, s = self.todo.popleft(), self.free.popleft()
            try:
                self.start(index, s)
            except XlogError as exc:  # allocating the slot's buffers failed: nothing was sent
                self.free.append(s)
                self.errors.append(f"copy in, batch {index}: {exc!r}")
        moved = False
        for batch in list(self.inflight):
            moved |= self.advance(batch)
        if not moved and self.inflight:
            landing = any(b.stage == 2 for b in self.inflight)
            try:
                # Keys are only a wake-up: every batch is looked at again on the next step.
                self.replies.get(timeout=_LANDING_POLL_S if landing else timeout)
            except queue.Empty:
                pass


def run_pipeline(
    driver: Driver,
    cfg: PipelineConfig,
    ordinal: int = 0,
    device: pykka.ActorRef[Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> PipelineResult:
    """Run the pipeline on ``driver``'s device ``ordinal`` (or an already started ``device``)
    and verify every batch exactly.

    The inputs, the ring's buffers and the kernels are made and loaded before timing starts;
    ``seconds`` runs from the first copy in to the last batch verified.

    Args:
        driver: the driver to run on.
        cfg: the run's shape.
        ordinal: the device, when ``device`` is not given.
        device: a started ``DeviceActor`` to use (not stopped here); None starts one (stopped after).
        progress: called with ``(done, total)`` about five times a second and at the end.
    Returns:
        The result; a run that times out after ``cfg.timeout_s`` says so in ``errors``, and so
        does one that meets an error other than a stale handle (the run stops there).
    Raises:
        ValueError: ``batch_bytes`` is not a positive multiple of 4, or ``batches``/``depth`` < 1
            (nothing would ever finish).
    Thread rule: any thread but the pipeline's own actors' (it blocks until the run ends).
    """
    if cfg.batch_bytes % 4 or cfg.batch_bytes <= 0:
        raise ValueError(f"batch_bytes must be a positive multiple of 4, got {cfg.batch_bytes}")
    if cfg.batches < 1 or cfg.depth < 1:
        raise ValueError(f"batches and depth must be at least 1, got batches={cfg.batches} depth={cfg.depth}")
    own_device = device is None
    if device is None:
        device = DeviceActor.start(ordinal, driver)
    started: list[pykka.ActorRef[Any]] = []
    try:
        # depth + 1 distinct inputs: a ring slot never gets the input it held before, so a kernel
        # that reads its input too early (tracking off) reads the wrong numbers.
        dev = device

        def input_buffer(nbytes: int) -> np.ndarray:
            buffer = _host_buffer(dev, nbytes)
            inputs.append(buffer)  # the owner stays referenced until the run ends
            return _host_array(buffer)

        inputs: list[Any] = []
        data = BatchData(cfg.depth + 1, cfg.batch_bytes, input_buffer)
        started.append(CopyActor.start(device, track=cfg.track))
        started.append(KernelActor.start(device, track=cfg.track))
        started.append(CopyActor.start(device, track=cfg.track))
        run = _Run(device, tuple(started), cfg, data, driver)
        try:
            run.warm_up()
        except XlogError as exc:
            run.errors.append(f"warm-up: {exc!r}")
        seconds = _drive(run, cfg, progress)
        stats = device.ask(GetStats(), block=True)
    finally:
        for ref in reversed(started):
            ref.stop()
        if own_device:
            device.stop()
    return PipelineResult(
        batches=cfg.batches,
        batch_bytes=cfg.batch_bytes,
        verified=run.verified,
        mismatched=sorted(run.mismatched),
        stale_retries=run.stale_retries,
        errors=run.errors,
        seconds=seconds,
        generation=stats.generation,
        driver=driver.kind,
        device=driver.device_name(ordinal),
        compared=run.compared,
    )


def _drive(run: _Run, cfg: PipelineConfig, progress: Callable[[int, int], None] | None) -> float:
    """Step ``run`` until every batch is verified, an error stops it, or it times out; its seconds."""
    t0 = time.perf_counter()
    deadline = t0 + cfg.timeout_s
    next_report = t0 + 0.2
    while run.done < cfg.batches and not run.errors:
        run.step(0.05)
        now = time.perf_counter()
        if progress is not None and now >= next_report:
            progress(run.done, cfg.batches)
            next_report = now + 0.2
        if now > deadline:
            run.errors.append(f"timed out after {cfg.timeout_s} s")
    seconds = time.perf_counter() - t0
    # An error stops new work; what is in flight still finishes, so no buffer is dropped in use.
    for batch in list(run.inflight):
        for future in batch.futures:
            _outcome(future, max(0.0, deadline - time.perf_counter()))
    if progress is not None:
        progress(run.done, cfg.batches)
    return seconds
