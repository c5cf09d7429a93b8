"""The demo pipeline: copy in, kernel, copy out of consecutive batches at once, on the streams of
three library actors (a ``CopyActor`` in, a ``KernelActor``, a ``CopyActor`` out), over a ring of
``depth`` device buffer sets.

One thread orchestrates, and it waits on one queue only. Every ask goes out with
``ask_served``: an ask the library actor serves in this thread (it was idle) answers at once, and
the batch's next stage is sent right then; any other answer (the reply or its error) is posted on
that queue with the batch as its key, once the actor has *enqueued* the stage (the device work
goes on). A batch is three asks: its copy in, its kernel, and one copy back of its output with
the checksum behind it. When
the copy back is enqueued, the orchestrator watches it land itself (``_Landing``: a query per
look, a blocking wait on the oldest only when no other answer can come). The orchestrator never
waits for one batch while another has a stage to send. No code here synchronizes the device: the
library actors' tracking orders every stage after the one before it on another stream, and a ring
buffer's reuse after its last reader.

The inputs are built once, before timing starts (:class:`~.batches.BatchData`). Every batch is
verified exactly, off the critical path: the kernel, ``SCALE_ADD_CHECKSUM_F32``, writes the
output and adds its checksum into an 8-byte running sum just past it in the same buffer (its
start is the poison the slot is filled with when allocated); those 8 bytes come back with the
output in the same copy, and what the batch added is compared with the checksum computed once per
distinct input. The first and the last batch also come back into buffers of their own, compared
byte for byte with the host reference once the timed run is over, so a checksum collision cannot
hide a wrong result and the comparison costs the run nothing.

A stage that meets a stale handle (a ``Rebuild`` mid-run) reports it; the batch is run again on
newly allocated buffers. A sticky error (``cfg.fault_at`` plants one, a kernel that stores to
address 16) ends the run: a poisoned context serves nothing more in its process, so a run on
several devices (:mod:`.multi_pipeline`) gives the batches left to a new worker process.

Past 400 lines because one run is one concept: the ring, the batches in flight, their stale
retries and verification share one state, and the host-memory seams sit beside the one user.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pykka

from ..actors import CopyActor, DeviceActor, GpuRef, KernelActor
from ..actors.library_messages import CopyDone, CopyToDevice, CopyToHost, Fill, In, Launch, Out
from ..actors.messages import Allocate, AllocatePinned, GetStats, Rebuild
from ..actors.pykka_internals import Answer, ask_served
from ..driver.kernel import Kernel
from ..driver.kernel_library import SCALE_ADD_CHECKSUM_F32, checksum_tail, launch_shape
from ..driver.protocol import Driver
from ..errors import GpuRefStale, XlogError
from ..memory.block import AllocTag
from ..memory.pinned import PinnedBuffer
from .batches import ALPHA, BETA, BatchData, Tally

__all__ = ["ILLEGAL_STORE", "PipelineConfig", "PipelineResult", "run_pipeline"]

_INPUT = AllocTag("demo-input")
_OUTPUT = AllocTag("demo-output")
_POISON = 0xDD  # what the host driver writes over freed memory too
_POISONED_SUM = int.from_bytes(bytes([_POISON]) * 8, "little")

#: **Test hook** ``(p: u64)``: one store to address ``p`` (launched with 16): a sticky
#: ``CUDA_ERROR_ILLEGAL_ADDRESS`` on a GPU, the host driver's checked-memory equivalent (the
#: device is poisoned) elsewhere. What ``PipelineConfig.fault_at`` launches.
ILLEGAL_STORE = Kernel(
    name="xlog_demo_store_to_16",
    params=("u64",),
    host=lambda mem, grid, block, ptr: mem.array(ptr, 4, np.uint8).fill(1),
    source='extern "C" __global__ void xlog_demo_store_to_16(unsigned long long p) { *(volatile int*)p = 1; }',
)


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
    fault_at: int | None = None  # test hook: launch ILLEGAL_STORE (a sticky error) when this batch is copied in
    timeout_s: float = 600.0
    graph: bool = False  # graph_pipeline.job_for runs the graph mode (run_graph_pipeline), not the actors
    graph_lanes: int | None = None  # graph mode: batches per replay (None: by batch size, graph_pipeline.lanes_for)


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
# and copies back go through ``_copy_back_message``/``_wait_landed``/``batches.landed_output``. They are
# the only code that knows whether host memory is pinned; everything else holds the buffer objects
# they hand out.


def _host_buffer(device: pykka.ActorRef[Any], nbytes: int) -> PinnedBuffer:
    """A pinned host buffer of ``nbytes`` for inputs and copies back, allocated through the device
    (copies from and to it need no staging, and its memory outlives no copy that uses it)."""
    buffer: PinnedBuffer = device.ask(AllocatePinned(nbytes, tag=AllocTag("demo host")), block=True)
    return buffer


def _host_array(buffer: PinnedBuffer) -> np.ndarray:
    """``buffer`` (from ``_host_buffer``) as a uint8 numpy array over the same bytes."""
    return buffer.array(np.uint8)


def _copy_back_message(ref: GpuRef, nbytes: int, out: PinnedBuffer) -> CopyToHost:
    """The message that copies ``nbytes`` of ``ref`` into ``out`` (a buffer from ``_host_buffer``);
    its answer is a ``CopyDone`` once the copy is enqueued. Immutable, so one serves every batch
    of the same buffers."""
    return CopyToHost(ref, nbytes, out=out)


def _wait_landed(reply: CopyDone) -> None:
    """Block until the copy back behind ``reply`` (a ``CopyDone``) has landed in its buffer."""
    reply.wait()


@dataclass
class _Slot:
    """One device ring entry: the buffers a batch is copied into, computed in and copied back from.

    A slot is taken by the next batch as soon as this batch's copies back are *enqueued*: what
    the next batch does to the buffers waits on the device for what this one still does (the
    handles' tracking), never on the host."""

    inp: GpuRef
    out: GpuRef  # the output, then (at ``checksum_tail``) the running checksum
    total: int = _POISONED_SUM  # the running checksum the device holds after the slot's last verified batch
    launch: Launch | None = None  # the batch's kernel on these buffers, built once
    # The copies in (by input) and back (by host set) of these buffers, each built once: a batch
    # sends the same immutable messages as the batches before it on the same buffers.
    copies_in: dict[int, CopyToDevice] = field(default_factory=dict)
    copies_back: dict[_HostSet, CopyToHost] = field(default_factory=dict)


@dataclass(eq=False)
class _HostSet:
    """Where one batch's copy back lands (pinned, from ``_host_buffer``): the output, then the
    checksum at byte ``tail``. A set is held from a batch's copy back until its checksum is read,
    so there are more sets than slots."""

    out: PinnedBuffer
    tail: int
    total: Any = None  # the checksum as one uint64, the view made once

    def __post_init__(self) -> None:
        self.total = self.out.array(np.uint64)[self.tail // 8 :]


@dataclass(eq=False)
class _Batch:
    """A batch in flight: its ring slot and its stage, whose one answer is still to come.
    Compared by identity: it is the key its answers are posted under."""

    index: int
    slot: int
    buffers: _Slot  # the slot's buffers when the batch started (a stale retry replaces the slot's)
    host: _HostSet
    stage: int  # 0: copy in sent; 1: kernel sent; 2: copy back sent; 3: landing
    holds_slot: bool = True  # until its copy back is enqueued


#: The value the landing thread posts once a batch's copies back are on the host.
_LANDED = "landed"
_STAGES = ("copy in", "kernel", "copy out", "copy out")


class _Landing:
    """The batches whose copies back are enqueued and not yet seen landed, oldest first. The
    orchestrator takes the ones that landed (a query each, which keeps the GIL) whenever it looks
    for answers, and blocks on the oldest only when nothing else can come: no thread of its own,
    so no GIL hand-off and no queue post per batch. Copies back land in the order they were
    enqueued on the one copy-out stream, so the oldest is always the next to land."""

    def __init__(self) -> None:
        self._todo: deque[tuple[_Batch, CopyDone]] = deque()

    def __bool__(self) -> bool:
        return bool(self._todo)

    def watch(self, batch: _Batch, reply: CopyDone) -> None:
        """Report ``batch`` once the copy behind ``reply`` has landed."""
        self._todo.append((batch, reply))

    def landed(self) -> list[Answer]:
        """The answers of the copies that have landed, oldest first (never blocks); a wait that
        raised (a rebuild while the copy was landing) is that batch's answer."""
        out: list[Answer] = []
        todo = self._todo
        while todo:
            batch, reply = todo[0]
            try:
                if not reply.done():
                    break
            except BaseException as exc:  # noqa: BLE001 - the orchestrator decides what it means
                out.append(Answer(batch, None, exc))
            else:
                out.append(Answer(batch, _LANDED, None))
            todo.popleft()
        return out

    def wait_oldest(self) -> Answer:
        """Block until the oldest copy has landed (the caller knows one is watched); its answer."""
        batch, reply = self._todo.popleft()
        try:
            _wait_landed(reply)
        except BaseException as exc:  # noqa: BLE001 - the orchestrator decides what it means
            return Answer(batch, None, exc)
        return Answer(batch, _LANDED, None)


class _Run:
    """The orchestrating thread's state: the ring, the batches in flight, the tally."""

    def __init__(self, device: pykka.ActorRef[Any], actors: tuple[pykka.ActorRef[Any], ...], cfg: PipelineConfig,
                 data: BatchData, driver: Driver, inputs: list[PinnedBuffer]) -> None:
        self.device, (self.copy_in, self.kernels, self.copy_out) = device, actors
        self.cfg, self.data, self.driver = cfg, data, driver
        # ``data``'s inputs as the pinned buffers they live in: a copy in from a PinnedBuffer is
        # known to only enqueue, so its ask is served in this thread (served_ref).
        self.inputs = inputs
        self.n = cfg.batch_bytes // 4
        self.shape = launch_shape(self.n)
        self.tail = checksum_tail(self.n)
        self.out_bytes = self.tail + 8  # what a batch's copy back carries: output and checksum
        self.replies: queue.SimpleQueue[Answer] = queue.SimpleQueue()
        self.landing = _Landing()
        self.asked = 0  # asks whose answer is still to be posted on ``replies``
        self.slots: list[_Slot | None] = [None] * cfg.depth
        self.free = deque(range(cfg.depth))
        self.hosts: deque[_HostSet] = deque()  # free host sets; 2 * depth at most are made
        self.host_sets = 0
        self.todo = deque(range(cfg.batches))
        self.inflight: set[_Batch] = set()
        # The batches compared byte for byte copy their output back here, kept until the end.
        self.kept: dict[int, PinnedBuffer] = {}
        self.rebuilt = False
        self.faulted = False
        self.tally = Tally(data, self.kept)
        self.stale_retries = 0
        self.errors: list[str] = []

    @property
    def done(self) -> int:
        """Batches verified (or waiting for their byte compare) or found wrong."""
        return self.tally.done

    def slot(self, s: int) -> _Slot:
        """Slot ``s``, allocated first if it has no buffers (at the start, after a stale handle)."""
        slot = self.slots[s]
        if slot is None:
            inp: GpuRef = self.device.ask(Allocate(self.cfg.batch_bytes, tag=_INPUT), block=True)
            out: GpuRef = self.device.ask(Allocate(self.out_bytes, tag=_OUTPUT), block=True)
            slot = self.slots[s] = _Slot(inp, out)
            # Fresh pool memory may still hold an earlier run's batches at the same addresses
            # (a warm pool hands them out again in order): poisoned, a read that comes too early
            # (tracking off) sees bytes no batch has, instead of an earlier run's right answer.
            # The running checksum at the output's tail starts as the poison too: what a batch
            # added is the difference, modulo 2**64, so no separate zeroing is needed.
            self.copy_in.ask(Fill(inp, _POISON), block=True)
            self.copy_in.ask(Fill(out, _POISON), block=True)
        return slot

    def warm_up(self) -> None:
        """Allocate the ring, the host sets and the kept buffers, and compile and load the three
        kernels before timing (NVRTC compiles on the first launch)."""
        for s in range(self.cfg.depth):
            self.slot(s)
        while self.host_sets < 2 * self.cfg.depth:
            self.hosts.append(self._new_host_set())
        for index in {0, self.cfg.batches - 1}:
            self.kept[index] = _host_buffer(self.device, self.out_bytes)
        slot = self.slot(0)
        # One element (its checksum lands at byte 8, among the elements), then poisoned again.
        grid, block = launch_shape(1)
        self.kernels.ask(Launch(SCALE_ADD_CHECKSUM_F32, grid, block, [Out(slot.out), In(slot.inp), ALPHA, BETA, 1]))
        self.copy_in.ask(Fill(slot.out, _POISON), block=True)

    def _new_host_set(self) -> _HostSet:
        host = _HostSet(_host_buffer(self.device, self.out_bytes), self.tail)
        self.host_sets += 1
        return host

    def _send(self, batch: _Batch, stage: int) -> None:
        """Send ``batch``'s ask of ``stage`` (1: the kernel; 2: the copy back)."""
        slot = batch.buffers
        batch.stage = stage
        if stage == 1:
            if slot.launch is None:  # the same message serves every batch of the slot
                grid, block = self.shape
                args = [Out(slot.out), In(slot.inp), ALPHA, BETA, self.n]
                slot.launch = Launch(SCALE_ADD_CHECKSUM_F32, grid, block, args)
            self._took(ask_served(self.kernels, slot.launch, self.replies, batch))
        else:
            kept = self.kept.get(batch.index)  # the batches compared byte for byte land apart
            message = None if kept is not None else slot.copies_back.get(batch.host)
            if message is None:
                message = _copy_back_message(slot.out, self.out_bytes, batch.host.out if kept is None else kept)
                if kept is None:
                    slot.copies_back[batch.host] = message
            self._took(ask_served(self.copy_out, message, self.replies, batch))

    def _took(self, answer: Answer | None) -> None:
        """After an ask: its answer, when it was served in this thread, is taken now (which sends
        the batch's next stage at once); else it is to come on ``replies``."""
        if answer is None:
            self.asked += 1
        else:
            self.on_answer(answer)

    def start(self, index: int, s: int) -> None:
        """Send batch ``index``'s copy in to slot ``s``, with the next free host set."""
        slot = self.slot(s)
        if self.cfg.producer_delay_us:
            self._slow_producer(slot.inp)
        host = self.hosts.popleft() if self.hosts else self._new_host_set()
        batch = _Batch(index, s, slot, host, 0)
        self.inflight.add(batch)
        k = index % len(self.inputs)
        message = slot.copies_in.get(k)
        if message is None:
            message = slot.copies_in[k] = CopyToDevice(slot.inp, self.inputs[k])
        self._took(ask_served(self.copy_in, message, self.replies, batch))

    def _slow_producer(self, ref: GpuRef) -> None:
        # A spin on the copy actor's stream before the copy: what tracking must order after.
        stream_id = self.copy_in.proxy().stream_id.get()
        stream = ref.context.runtime.stream_pool.resolve(stream_id)
        if stream is not None:
            self.driver.sleep(stream, self.cfg.producer_delay_us)

    def on_answer(self, answer: Answer) -> None:
        """Take one answer; once its batch's stage is complete, send the next stage (or verify)."""
        batch = answer.key
        assert isinstance(batch, _Batch)
        if batch not in self.inflight:
            return  # a batch already retired by an error of this stage's other answer
        if answer.error is not None:
            self._failed(batch, answer.error)
        elif self.errors:
            self._retire(batch)  # the run is stopping: nothing new is sent
        elif batch.stage == 0:
            if self.cfg.rebuild_at == batch.index and not self.rebuilt:
                self._rebuild(batch.index)  # after the copy in was enqueued, before its kernels
            if self.cfg.fault_at == batch.index and not self.faulted:
                self._strike(batch.index)  # the batches in flight meet it
            self._send(batch, 1)
        elif batch.stage == 1:
            self._send(batch, 2)
        elif batch.stage == 2:
            # The copy back is enqueued: the slot goes to the next batch now (see _Slot).
            batch.stage = 3
            self._release_slot(batch)
            self.landing.watch(batch, answer.value)
        else:
            self._verify(batch)
            self._retire(batch)

    def _rebuild(self, index: int) -> None:
        self.rebuilt = True
        try:
            self.device.ask(Rebuild("demo: rebuild mid-pipeline"))
        except XlogError as exc:
            self.errors.append(f"rebuild at batch {index}: {exc!r}")

    def _strike(self, index: int) -> None:
        self.faulted = True
        try:
            self.kernels.ask(Launch(ILLEGAL_STORE, 1, 1, [16]))
        except XlogError as exc:  # met at once (it is met by a later call otherwise)
            self.errors.append(f"injected fault at batch {index}: {exc!r}")

    def _verify(self, batch: _Batch) -> None:
        # The batches of one slot land in the order they ran (one copy-out stream, watched in
        # order), so ``slot.total`` is the previous one's sum.
        index, slot = batch.index, batch.buffers
        kept = self.kept.get(index)
        total = int(batch.host.total[0] if kept is None else kept.array(np.uint64)[self.tail // 8])
        self.tally.checksum(index, slot.total, total)
        slot.total = total

    def _failed(self, batch: _Batch, exc: BaseException) -> None:
        """A stale handle (a rebuild happened) runs the batch again on new buffers; any other
        error ends the run."""
        self._retire(batch)
        if isinstance(exc, GpuRefStale) or (batch.stage == 3 and self._stale(batch.buffers)):
            # (A rebuild while a copy back was landing fails the wait with a DriverError.)
            self.stale_retries += 1
            if self.slots[batch.slot] is batch.buffers:  # not yet replaced by another retry
                self.slots[batch.slot] = None
            self.todo.appendleft(batch.index)
        else:
            self.errors.append(f"{_STAGES[batch.stage]}, batch {batch.index}: {exc!r}")

    @staticmethod
    def _stale(slot: _Slot) -> bool:
        try:
            slot.out.raw_device_ptr()
        except GpuRefStale:
            return True
        return False

    def _release_slot(self, batch: _Batch) -> None:
        if batch.holds_slot:
            batch.holds_slot = False
            self.free.append(batch.slot)

    def _retire(self, batch: _Batch) -> None:
        self.inflight.discard(batch)
        self._release_slot(batch)
        self.hosts.append(batch.host)

    def step(self, timeout: float) -> None:
        """Start what the ring has room for, then take the next answer (waiting up to
        ``timeout`` s for it) and every answer already in."""
        while self.free and (self.hosts or self.host_sets < 2 * self.cfg.depth) and self.todo and not self.errors:
            index, s = self.todo.popleft(), self.free.popleft()
            try:
                self.start(index, s)
            except XlogError as exc:  # allocating the slot's buffers failed: nothing was sent
                self.free.append(s)
                self.errors.append(f"copy in, batch {index}: {exc!r}")
        if not self.inflight:
            return
        if self._take_ready():
            return
        if self.asked or not self.landing:
            # An answer is still to come from an actor's own thread: wait for it (the copies
            # back are looked at again on the next step).
            try:
                answer = self.replies.get(timeout=timeout)
            except queue.Empty:
                return
            self._answered(answer)
        else:
            self.on_answer(self.landing.wait_oldest())
        self._take_ready()

    def _take_ready(self) -> bool:
        """Take every answer already in and every copy back already landed; whether any was."""
        took = False
        while self.asked:  # answers served in this thread were taken as they came
            try:
                answer = self.replies.get_nowait()
            except queue.Empty:
                break
            self._answered(answer)
            took = True
        for answer in self.landing.landed():
            self.on_answer(answer)
            took = True
        return took

    def _answered(self, answer: Answer) -> None:
        self.asked -= 1
        self.on_answer(answer)

    def finish(self, deadline: float) -> None:
        """After an error or a timeout: take the answers of what is still in flight (nothing new
        is sent), so no buffer is dropped while in use."""
        while self.inflight and time.perf_counter() < deadline:
            if self._take_ready():
                continue
            if self.asked or not self.landing:
                try:
                    self._answered(self.replies.get(timeout=max(0.0, deadline - time.perf_counter())))
                except queue.Empty:
                    break
            else:
                self.on_answer(self.landing.wait_oldest())


def run_pipeline(
    driver: Driver,
    cfg: PipelineConfig,
    ordinal: int = 0,
    device: pykka.ActorRef[Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
    start_gate: Callable[[], None] | None = None,
    on_verified: Callable[[int], None] | None = None,
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
        start_gate: called once everything is made and loaded, just before the clock starts (a
            run on several devices waits there until every device is ready).
        on_verified: called with the batches verified so far (checksum and, for the two
            compared byte for byte, that compare too) as often as ``progress`` and at the end: a
            count that never takes in a batch not verified.
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
    run: _Run | None = None
    try:
        # depth + 1 distinct inputs: a ring slot never gets the input it held before, so a kernel
        # that reads its input too early (tracking off) reads the wrong numbers.
        dev = device

        def input_buffer(nbytes: int) -> np.ndarray:
            buffer = _host_buffer(dev, nbytes)
            inputs.append(buffer)  # the owner stays referenced until the run ends
            return _host_array(buffer)

        inputs: list[PinnedBuffer] = []
        data = BatchData(cfg.depth + 1, cfg.batch_bytes, input_buffer)
        started.append(CopyActor.start(device, track=cfg.track))
        started.append(KernelActor.start(device, track=cfg.track))
        started.append(CopyActor.start(device, track=cfg.track))
        run = _Run(device, tuple(started), cfg, data, driver, inputs)
        try:
            run.warm_up()
        except XlogError as exc:
            run.errors.append(f"warm-up: {exc!r}")
        if start_gate is not None:
            start_gate()
        seconds, cpu = _drive(run, cfg, progress, on_verified)
        stats = device.ask(GetStats(), block=True)
    finally:
        for ref in reversed(started):
            ref.stop()
        if own_device:
            device.stop()
    return PipelineResult(
        batches=cfg.batches,
        batch_bytes=cfg.batch_bytes,
        verified=run.tally.verified,
        mismatched=sorted(run.tally.mismatched),
        stale_retries=run.stale_retries,
        errors=run.errors,
        seconds=seconds,
        generation=stats.generation,
        driver=driver.kind,
        device=driver.device_name(ordinal),
        compared=run.tally.compared,
        extra={"cpu_seconds": cpu, "mode": "actors"},
    )


def _drive(run: _Run, cfg: PipelineConfig, progress: Callable[[int, int], None] | None,
           on_verified: Callable[[int], None] | None = None) -> tuple[float, float]:
    """Step ``run`` until every batch is verified, an error stops it, or it times out; its seconds
    and the process's CPU seconds, all threads (the byte compares of the kept batches come after
    the clocks stop; after an error too, for those that landed: they are on the host)."""
    t0, c0 = time.perf_counter(), time.process_time()
    deadline = t0 + cfg.timeout_s
    reports = progress is not None or on_verified is not None
    next_report = t0 + 0.2 if reports else deadline
    try:
        while run.done < cfg.batches and not run.errors:
            run.step(max(0.0, min(next_report, deadline) - time.perf_counter()))
            now = time.perf_counter()
            if reports and now >= next_report:
                _report(run, cfg, progress, on_verified)
                next_report = now + 0.2
            if now > deadline:
                run.errors.append(f"timed out after {cfg.timeout_s} s")
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        run.tally.compare_kept(cfg.batch_bytes)
    finally:
        # An error stops new work; what is in flight still finishes, so no buffer is dropped in use.
        run.finish(deadline)
    if reports:
        _report(run, cfg, progress, on_verified)
    return seconds, cpu


def _report(run: _Run, cfg: PipelineConfig, progress: Callable[[int, int], None] | None,
            on_verified: Callable[[int], None] | None) -> None:
    if progress is not None:
        progress(run.done, cfg.batches)
    if on_verified is not None:
        on_verified(run.tally.verified)
