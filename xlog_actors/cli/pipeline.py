"""The demo pipeline: a producer, a transformer and a consumer actor, each with its own library
actor (so its own stream), passing ``GpuRef``s through N batches of copy in, kernel, copy out.

No user code here synchronizes anything: the library actors' tracking orders every stage after
the one before it. A stage that meets a stale handle (a ``Rebuild`` mid-pipeline) reports it
and the batch is produced again with new buffers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pykka

from ..actors import (
    Allocate,
    CopyActor,
    CopyToDevice,
    CopyToHost,
    DeviceActor,
    GetStats,
    In,
    KernelActor,
    Launch,
    Out,
    Rebuild,
)
from ..driver.kernel_library import SCALE_ADD_F32, launch_shape
from ..driver.protocol import Driver
from ..errors import GpuRefStale, XlogError
from ..memory.block import AllocTag

__all__ = ["ALPHA", "BETA", "PipelineConfig", "PipelineResult", "expected", "make_batch", "run_pipeline"]

ALPHA = 3.0
"""The kernel's scale: each output element is ``ALPHA * x + BETA``."""
BETA = 0.5
"""The kernel's offset."""
_INPUT = AllocTag("demo-input")
_OUTPUT = AllocTag("demo-output")


def make_batch(index: int, n: int) -> np.ndarray:
    """Batch ``index``: small integers, so every result is exact in float32.

    Args:
        index: the batch's number (varies the values).
        n: elements.
    Returns:
        A new float32 array of ``n`` elements.
    Thread rule: any thread.
    """
    return ((np.arange(n, dtype=np.int64) * 7 + index * 13) % 4096).astype(np.float32)


def expected(index: int, n: int) -> np.ndarray:
    """The host reference of batch ``index`` after the kernel: ``ALPHA * x + BETA`` in float32.

    Args:
        index: the batch's number.
        n: elements.
    Returns:
        A new float32 array.
    Thread rule: any thread.
    """
    out: np.ndarray = make_batch(index, n) * np.float32(ALPHA)
    out += np.float32(BETA)
    return out


@dataclass
class PipelineConfig:
    """How a pipeline run is shaped. ``batches`` and ``depth`` must be at least 1 (the command
    line checks them), ``batch_bytes`` a positive multiple of 4, ``rebuild_at`` a batch index.

    Thread rule: build it, then hand it to :func:`run_pipeline`; not changed after.
    """

    batches: int = 32
    batch_bytes: int = 1 << 20
    depth: int = 4  # batches in flight at once
    track: bool = True  # False: library actors skip cross-stream tracking (to show the hazard)
    producer_delay_us: int = 0  # a spin before each input copy: a slow producer stream
    rebuild_at: int | None = None  # ask the device for a Rebuild when this batch is produced
    timeout_s: float = 600.0


@dataclass
class PipelineResult:
    """What a pipeline run did: batches verified or mismatched, stale retries, errors, time.

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
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every batch verified, none mismatched, no error."""
        return self.verified == self.batches and not self.mismatched and not self.errors

    @property
    def throughput_bytes_s(self) -> float:
        """Input bytes through the whole pipeline per second."""
        return self.batches * self.batch_bytes / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class _Produce:
    index: int


@dataclass(frozen=True)
class _Transform:
    index: int
    ref: Any


@dataclass(frozen=True)
class _Consume:
    index: int
    ref: Any


class _Tally:
    """Shared by the three stages; the main thread waits on ``done``."""

    def __init__(self, batches: int) -> None:
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.remaining = batches
        self.verified = 0
        self.mismatched: list[int] = []
        self.stale_retries = 0
        self.errors: list[str] = []

    def finish(self, index: int, ok: bool) -> None:
        with self.lock:
            if ok:
                self.verified += 1
            else:
                self.mismatched.append(index)
            self.remaining -= 1
            if self.remaining == 0:
                self.done.set()

    def failed(self, stage: str, index: int, exc: XlogError, producer: pykka.ActorRef[Any]) -> None:
        """A stage's request for batch ``index`` failed. A stale handle (a rebuild happened)
        sends the batch back to ``producer`` to be made again; any other error ends the run."""
        if isinstance(exc, GpuRefStale):
            with self.lock:
                self.stale_retries += 1
            producer.tell(_Produce(index))
        else:
            self.fail(f"{stage}, batch {index}: {exc!r}")

    def fail(self, message: str) -> None:
        with self.lock:
            self.errors.append(message)
        self.done.set()


class _Producer(pykka.ThreadingActor):
    def __init__(self, device: pykka.ActorRef[Any], copy: pykka.ActorRef[Any], cfg: PipelineConfig,
                 tally: _Tally, driver: Driver) -> None:
        super().__init__()
        self.device, self.copy, self.cfg, self.tally, self.driver = device, copy, cfg, tally, driver
        self.next_index = 0
        self.n = cfg.batch_bytes // 4
        self.transformer: pykka.ActorRef[Any] | None = None
        self.rebuilt = False

    def on_receive(self, message: Any) -> None:
        if isinstance(message, _Produce):
            self.produce(message.index)
        elif message == "next":
            if self.next_index < self.cfg.batches:
                self.next_index += 1
                self.produce(self.next_index - 1)
        elif isinstance(message, pykka.ActorRef):
            self.transformer = message

    def produce(self, index: int) -> None:
        assert self.transformer is not None
        try:
            ref = self.device.ask(Allocate(self.cfg.batch_bytes, tag=_INPUT), block=True)
            if self.cfg.producer_delay_us:
                # Make the copy actor's stream slow before the copy: what tracking must order.
                ctx = ref.context
                copy_stream = self.copy.proxy().stream_id.get()
                stream = ctx.runtime.stream_pool.resolve(copy_stream)
                if stream is not None:
                    self.driver.sleep(stream, self.cfg.producer_delay_us)
            self.copy.ask(CopyToDevice(ref, make_batch(index, self.n)))
        except XlogError as exc:
            self.tally.failed("producer", index, exc, self.actor_ref)
            return
        if self.cfg.rebuild_at == index and not self.rebuilt:
            self.rebuilt = True
            self.device.ask(Rebuild("demo: rebuild mid-pipeline"))
        self.transformer.tell(_Transform(index, ref))


class _Transformer(pykka.ThreadingActor):
    def __init__(self, device: pykka.ActorRef[Any], kernels: pykka.ActorRef[Any], producer: pykka.ActorRef[Any],
                 consumer: pykka.ActorRef[Any], cfg: PipelineConfig, tally: _Tally) -> None:
        super().__init__()
        self.device, self.kernels, self.producer, self.consumer = device, kernels, producer, consumer
        self.cfg, self.tally = cfg, tally
        self.n = cfg.batch_bytes // 4

    def on_receive(self, message: Any) -> None:
        if not isinstance(message, _Transform):
            return
        try:
            out = self.device.ask(Allocate(self.cfg.batch_bytes, tag=_OUTPUT), block=True)
            grid, block = launch_shape(self.n)
            self.kernels.ask(Launch(SCALE_ADD_F32, grid, block, [Out(out), In(message.ref), ALPHA, BETA, self.n]))
        except XlogError as exc:
            self.tally.failed("transformer", message.index, exc, self.producer)
            return
        # The input handle is dropped here: its free waits (tracked) for the kernel's read.
        self.consumer.tell(_Consume(message.index, out))


class _Consumer(pykka.ThreadingActor):
    def __init__(self, copy: pykka.ActorRef[Any], producer: pykka.ActorRef[Any], cfg: PipelineConfig,
                 tally: _Tally, verify: Callable[[int, bytes], bool]) -> None:
        super().__init__()
        self.copy, self.producer, self.cfg, self.tally, self.verify = copy, producer, cfg, tally, verify

    def on_receive(self, message: Any) -> None:
        if not isinstance(message, _Consume):
            return
        try:
            data = self.copy.ask(CopyToHost(message.ref), block=True)
        except XlogError as exc:
            self.tally.failed("consumer", message.index, exc, self.producer)
            return
        self.tally.finish(message.index, self.verify(message.index, data))
        self.producer.tell("next")


def run_pipeline(
    driver: Driver,
    cfg: PipelineConfig,
    ordinal: int = 0,
    device: pykka.ActorRef[Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> PipelineResult:
    """Run the pipeline on ``driver``'s device ``ordinal`` (or an already started ``device``)
    and verify every batch against the host reference.

    Args:
        driver: the driver to run on.
        cfg: the run's shape.
        ordinal: the device, when ``device`` is not given.
        device: a started ``DeviceActor`` to use (not stopped here); None starts one (stopped after).
        progress: called with ``(done, total)`` about five times a second and at the end.
    Returns:
        The result; a run that times out after ``cfg.timeout_s`` says so in ``errors``.
    Raises:
        ValueError: ``batch_bytes`` is not a positive multiple of 4, or ``batches``/``depth`` < 1
            (nothing would ever finish).
    Thread rule: any thread but the pipeline's own actors' (it blocks until the run ends).
    """
    if cfg.batch_bytes % 4 or cfg.batch_bytes <= 0:
        raise ValueError(f"batch_bytes must be a positive multiple of 4, got {cfg.batch_bytes}")
    if cfg.batches < 1 or cfg.depth < 1:
        raise ValueError(f"batches and depth must be at least 1, got batches={cfg.batches} depth={cfg.depth}")
    n = cfg.batch_bytes // 4
    references: dict[int, bytes] = {}

    def verify(index: int, data: bytes) -> bool:
        want = references.get(index)
        if want is None:
            want = references[index] = expected(index, n).tobytes()
        return data == want

    own_device = device is None
    if device is None:
        device = DeviceActor.start(ordinal, driver)
    tally = _Tally(cfg.batches)
    started: list[pykka.ActorRef[Any]] = []
    try:
        copy_in = CopyActor.start(device, track=cfg.track)
        kernels = KernelActor.start(device, track=cfg.track)
        copy_out = CopyActor.start(device, track=cfg.track)
        started += [copy_in, kernels, copy_out]
        producer = _Producer.start(device, copy_in, cfg, tally, driver)
        consumer = _Consumer.start(copy_out, producer, cfg, tally, verify)
        transformer = _Transformer.start(device, kernels, producer, consumer, cfg, tally)
        started += [producer, consumer, transformer]
        producer.tell(transformer)
        t0 = time.perf_counter()
        for _ in range(min(cfg.depth, cfg.batches)):
            producer.tell("next")
        deadline = t0 + cfg.timeout_s
        while not tally.done.wait(0.2):
            if progress is not None:
                progress(cfg.batches - tally.remaining, cfg.batches)
            if time.perf_counter() > deadline:
                tally.fail(f"timed out after {cfg.timeout_s} s")
        seconds = time.perf_counter() - t0
        if progress is not None:
            progress(cfg.batches - tally.remaining, cfg.batches)
        stats = device.ask(GetStats(), block=True)
    finally:
        for ref in reversed(started):
            ref.stop()
        if own_device:
            device.stop()
    return PipelineResult(
        batches=cfg.batches,
        batch_bytes=cfg.batch_bytes,
        verified=tally.verified,
        mismatched=sorted(tally.mismatched),
        stale_retries=tally.stale_retries,
        errors=tally.errors,
        seconds=seconds,
        generation=stats.generation,
        driver=driver.kind,
        device=driver.device_name(ordinal),
    )
