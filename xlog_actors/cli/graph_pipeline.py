"""The demo pipeline in graph mode: each ring slot's batch (copy in, kernel, copy out) recorded
once as a :class:`~xlog_actors.actors.BatchGraph`, and every batch one replay of its slot's graph.

The job, the ring and the verification are those of :mod:`.pipeline`: ``depth`` device buffer
sets, ``depth + 1`` distinct pinned inputs, ``SCALE_ADD_CHECKSUM_F32`` adding each batch's
checksum into a running sum just past its output, copied back with it; the first and the last
batch also compared byte for byte after the timed run. What differs is how a batch is sent:

* one ``replay`` in the orchestrating thread instead of three asks of library actors. The slot's
  graph was recorded with the first input; a replay binds the batch's own input (one node
  update) and, for the batches compared byte for byte, a buffer of their own for the copy back;
* each slot's graph replays on its own stream, so batches of different slots overlap on the
  device (one's copy in beside another's kernel and a third's copy out), as the actor pipeline's
  three streams let them;
* before a slot takes its next batch, the orchestrator waits for the slot's previous replay and
  verifies it: the ring is the only back pressure, and the host output of a slot is read before
  the slot's next copy back overwrites it.

A rebuild mid-run (``rebuild_at``) makes the next replay raise ``GpuRefStale``: every batch whose
replay had not been verified is verified if its copy back landed before the rebuild, else run
again, on newly allocated buffers and newly recorded graphs.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pykka

from ..actors import BatchGraph, CopyActor, DeviceActor, GpuRef, GraphDone
from ..actors.library_messages import CopyToDevice, CopyToHost, Fill, In, Launch, Out
from ..actors.messages import Allocate, GetStats, Rebuild
from ..driver.kernel_library import SCALE_ADD_CHECKSUM_F32, checksum_tail, launch_shape
from ..driver.protocol import Driver
from ..errors import GpuRefStale, XlogError
from ..memory.pinned import PinnedBuffer
from .batches import ALPHA, BETA, BatchData, Tally
from .pipeline import _INPUT, _OUTPUT, _POISON, _POISONED_SUM, PipelineConfig, PipelineResult, _host_buffer

__all__ = ["run_graph_pipeline"]


@dataclass
class _GraphSlot:
    """One ring slot: its device buffers, its host output, its graph, its batch in flight."""

    inp: GpuRef
    out: GpuRef
    host: PinnedBuffer  # where the slot's copies back land (but the kept batches')
    graph: BatchGraph
    total: int = _POISONED_SUM  # the running checksum after the slot's last verified batch
    batch: int | None = None  # the batch replayed and not yet verified
    done: GraphDone | None = None


class _GraphRun:
    """One graph-mode run's state (see the module docstring)."""

    def __init__(self, device: pykka.ActorRef[Any], copy: pykka.ActorRef[Any], cfg: PipelineConfig,
                 data: BatchData, inputs: list[PinnedBuffer]) -> None:
        self.device, self.copy, self.cfg, self.data, self.inputs = device, copy, cfg, data, inputs
        self.n = cfg.batch_bytes // 4
        self.tail = checksum_tail(self.n)
        self.out_bytes = self.tail + 8
        self.hosts = [_host_buffer(device, self.out_bytes) for _ in range(cfg.depth)]
        self.kept = {index: _host_buffer(device, self.out_bytes) for index in {0, cfg.batches - 1}}
        # Each host output's running checksum as a one-element uint64 view, made once.
        self.sums = {id(h): h.array(np.uint64)[self.tail // 8:] for h in [*self.hosts, *self.kept.values()]}
        self.slots: list[_GraphSlot] = [self._new_slot(s) for s in range(cfg.depth)]
        self.todo: deque[int] = deque(range(cfg.batches))
        self.tally = Tally(data, self.kept)
        self.stale_retries = 0
        self.errors: list[str] = []
        self.rebuilt = False

    def _new_slot(self, s: int) -> _GraphSlot:
        """Slot ``s``'s buffers (poisoned, as :mod:`.pipeline` says why) and its recorded graph."""
        inp: GpuRef = self.device.ask(Allocate(self.cfg.batch_bytes, tag=_INPUT), block=True)
        out: GpuRef = self.device.ask(Allocate(self.out_bytes, tag=_OUTPUT), block=True)
        self.copy.ask(Fill(inp, _POISON))
        self.copy.ask(Fill(out, _POISON))
        grid, block = launch_shape(self.n)
        graph = BatchGraph.record(self.device, [
            CopyToDevice(inp, self.inputs[0]),
            Launch(SCALE_ADD_CHECKSUM_F32, grid, block, [Out(out), In(inp), ALPHA, BETA, self.n]),
            CopyToHost(out, self.out_bytes, out=self.hosts[s]),
        ])
        return _GraphSlot(inp, out, self.hosts[s], graph)

    @property
    def done(self) -> int:
        return self.tally.done

    def _verify(self, slot: _GraphSlot) -> None:
        """Wait for ``slot``'s batch in flight and check what it added to the running checksum."""
        index, done = slot.batch, slot.done
        if index is None or done is None:
            return
        slot.batch = slot.done = None
        done.wait()
        host = self.kept.get(index, slot.host)
        total = int(self.sums[id(host)][0])
        self.tally.checksum(index, slot.total, total)
        slot.total = total

    def step(self) -> None:
        """Send the next batch: verify its slot's previous one, then replay the slot's graph."""
        index = self.todo.popleft()
        s = index % self.cfg.depth
        slot = self.slots[s]
        self._verify(slot)
        if self.cfg.rebuild_at == index and not self.rebuilt:
            self.rebuilt = True
            self.device.ask(Rebuild("demo: rebuild mid-pipeline (graph mode)"))
        bind: dict[Any, Any] = {self.inputs[0]: self.inputs[index % len(self.inputs)],
                                self.hosts[s]: self.kept.get(index, self.hosts[s])}
        try:
            slot.done = slot.graph.replay(bind)
        except GpuRefStale:
            self.stale_retries += 1
            self.todo.appendleft(index)
            self._after_rebuild()
            return
        slot.batch = index

    def _after_rebuild(self) -> None:
        """Every slot's handles are stale: verify what landed, run the rest again, on new slots."""
        for slot in self.slots:
            if slot.batch is None:
                continue
            index = slot.batch
            try:
                self._verify(slot)
            except XlogError:  # the copy back's event went with the context: run it again
                self.stale_retries += 1
                self.todo.appendleft(index)
        for slot in self.slots:
            slot.graph.close()
        self.slots = [self._new_slot(s) for s in range(self.cfg.depth)]

    def drain(self) -> None:
        """Verify every batch still in flight."""
        for slot in self.slots:
            self._verify(slot)

    def close(self) -> None:
        for slot in self.slots:
            slot.graph.close()


def run_graph_pipeline(
    driver: Driver,
    cfg: PipelineConfig,
    ordinal: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> PipelineResult:
    """Run the demo pipeline in graph mode (see the module docstring) and verify every batch.

    Args:
        driver: the driver to run on.
        cfg: the run's shape (``track`` and ``producer_delay_us`` do not apply: a graph's stages
            are ordered by the graph itself).
        ordinal: the device.
        progress: called with ``(done, total)`` about five times a second and at the end.
    Returns:
        The result; ``extra["cpu_seconds"]`` is the process's CPU time (all threads) over the
        timed part. A run that meets an error other than a stale handle says so in ``errors``.
    Raises:
        ValueError: ``batch_bytes`` is not a positive multiple of 4, or ``batches``/``depth`` < 1.
    Thread rule: any thread; it blocks until the run ends.
    """
    if cfg.batch_bytes % 4 or cfg.batch_bytes <= 0:
        raise ValueError(f"batch_bytes must be a positive multiple of 4, got {cfg.batch_bytes}")
    if cfg.batches < 1 or cfg.depth < 1:
        raise ValueError(f"batches and depth must be at least 1, got batches={cfg.batches} depth={cfg.depth}")
    device = DeviceActor.start(ordinal, driver)
    copy: pykka.ActorRef[Any] | None = None
    run: _GraphRun | None = None
    seconds = cpu = 0.0
    errors: list[str] = []
    try:
        copy = CopyActor.start(device)
        inputs: list[PinnedBuffer] = []

        def input_buffer(nbytes: int) -> np.ndarray:
            buffer = _host_buffer(device, nbytes)
            inputs.append(buffer)
            return buffer.array(np.uint8)

        data = BatchData(cfg.depth + 1, cfg.batch_bytes, input_buffer)
        try:
            run = _GraphRun(device, copy, cfg, data, inputs)
        except XlogError as exc:
            errors.append(f"warm-up: {exc!r}")
        if run is not None:
            seconds, cpu = _drive(run, cfg, progress)
            errors = run.errors
        stats = device.ask(GetStats(), block=True)
    finally:
        if run is not None:
            run.close()
        if copy is not None:
            copy.stop()
        device.stop()
    return PipelineResult(
        batches=cfg.batches,
        batch_bytes=cfg.batch_bytes,
        verified=0 if run is None else run.tally.verified,
        mismatched=[] if run is None else sorted(run.tally.mismatched),
        stale_retries=0 if run is None else run.stale_retries,
        errors=errors,
        seconds=seconds,
        generation=stats.generation,
        driver=driver.kind,
        device=driver.device_name(ordinal),
        compared=0 if run is None else run.tally.compared,
        extra={"cpu_seconds": cpu, "mode": "graph"},
    )


def _drive(run: _GraphRun, cfg: PipelineConfig, progress: Callable[[int, int], None] | None) -> tuple[float, float]:
    """Replay until every batch is sent, then verify the rest; (seconds, CPU seconds)."""
    t0, c0 = time.perf_counter(), time.process_time()
    deadline = t0 + cfg.timeout_s
    next_report = t0 + 0.2
    try:
        while run.todo and not run.errors:
            run.step()
            now = time.perf_counter()
            if progress is not None and now >= next_report:
                progress(run.done, cfg.batches)
                next_report = now + 0.2
            if now > deadline:
                run.errors.append(f"timed out after {cfg.timeout_s} s")
        run.drain()
    except XlogError as exc:
        run.errors.append(f"replay: {exc!r}")
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    if not run.errors:
        run.tally.compare_kept(cfg.batch_bytes)
    if progress is not None:
        progress(run.done, cfg.batches)
    return seconds, cpu
