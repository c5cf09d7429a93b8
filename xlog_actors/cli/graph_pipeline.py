"""The demo pipeline in graph mode: the ring's slots (copy in, kernel, copy out of each) recorded
once as the lanes of :class:`~xlog_actors.actors.BatchGraph` s, and every replay one batch a lane.

The job, the ring and the verification are those of :mod:`.pipeline`: ``depth`` device buffer
sets, ``depth + 1`` distinct pinned inputs, ``SCALE_ADD_CHECKSUM_F32`` adding each batch's
checksum into a running sum just past its output, copied back with it; the first and the last
batch also compared byte for byte after the timed run. What differs is how batches are sent:

* the ring's slots form groups of :func:`lanes_for` slots, each group one graph whose lanes are
  its slots (lanes run side by side on the device); one ``replay`` in the orchestrating thread
  sends a batch through every lane, instead of three asks of library actors per batch. Lane
  ``k`` reads input ``first + k`` (of ``depth + 1``, turning over): a group of several lanes
  has a graph derived for each arrangement of the inputs (``BatchGraph.derive``), so the usual
  replay binds nothing and updates no node; the batches compared byte for byte (a buffer of
  their own for the copy back) and the run's last replay go through the group's own graph, bound
  for them, as every replay of a one-lane group does (one node update beside a large batch's
  copies).
  Several lanes a replay pay the launch, the tracking and the completion once for all of them,
  which is what small batches need; large ones take one lane a replay;
* each group's graph replays on its own stream, so batches of different groups overlap on the
  device (one's copies in beside another's kernels and copies out), as the actor pipeline's
  three streams let them;
* before a group takes its next batches, the orchestrator waits for the group's previous replay
  and verifies each of its batches: the ring is the only back pressure, and a slot's host output
  is read before its next copy back overwrites it. The run's last replay may have fewer batches
  than lanes: the extra lanes replay as spares, their sums read but not counted.

A rebuild mid-run (``rebuild_at``) makes the next replay raise ``GpuRefStale``: every batch whose
replay had not been verified is verified if its copy back landed before the rebuild, else run
again, on newly allocated buffers and newly recorded graphs.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pykka

from ..actors import BatchGraph, CopyActor, DeviceActor, GpuRef, GraphDone
from ..actors.batch_graph import Stage
from ..actors.library_messages import CopyToDevice, CopyToHost, Fill, In, Launch, Out
from ..actors.messages import Allocate, GetStats, Rebuild
from ..driver.kernel_library import SCALE_ADD_CHECKSUM_F32, checksum_tail, launch_shape
from ..driver.protocol import Driver
from ..errors import GpuRefStale, XlogError
from ..memory.pinned import PinnedBuffer
from .batches import ALPHA, BETA, BatchData, Tally
from .pipeline import (
    _INPUT,
    _OUTPUT,
    _POISON,
    _POISONED_SUM,
    PipelineConfig,
    PipelineResult,
    _host_buffer,
    run_pipeline,
)

__all__ = ["job_for", "lanes_for", "run_graph_pipeline"]


@dataclass
class _Lane:
    """One ring slot: its device buffers, its host output, its batch in flight."""

    inp: GpuRef
    out: GpuRef
    host: PinnedBuffer  # where the slot's copies back land (but the kept batches')
    total: int = _POISONED_SUM  # the running checksum after the slot's last verified batch
    batch: int | None = None  # the batch replayed and not yet verified
    bound_host: PinnedBuffer | None = None  # what the lane's copy back is bound to (None: host)


@dataclass
class _Group:
    """Consecutive ring slots recorded as the lanes of one graph: one replay sends a batch
    through each of them."""

    first: int  # the index of its first slot in the ring
    lanes: list[_Lane]
    graph: BatchGraph
    done: GraphDone | None = None
    #: graphs derived from ``graph``, by the first lane's input: lane ``j`` reads input
    #: ``(first + j) % len(inputs)`` and copies back into its slot's host output
    arranged: dict[int, BatchGraph] = field(default_factory=dict)

    def close(self) -> None:
        for graph in [self.graph, *self.arranged.values()]:
            graph.close()


def lanes_for(cfg: PipelineConfig) -> int:
    """How many ring slots one graph holds (batches per replay): ``cfg.graph_lanes``, or when
    None, half the ring (two replays in flight) for batches of at most 1 MiB, where a replay's
    launch, tracking and bindings take about as long as the batch's copies or longer, so that
    paying them once for several batches is what moves them faster, and 1 above, where the
    copies take far longer; never more than the ring. Thread rule: any thread."""
    if cfg.graph_lanes is not None:
        return max(1, min(cfg.graph_lanes, cfg.depth))
    return max(1, cfg.depth // 2) if cfg.batch_bytes <= SMALL_BATCH else 1


#: The largest batch that ``lanes_for`` sends several to a replay.
SMALL_BATCH = 1 << 20


class _GraphRun:
    """One graph-mode run's state (see the module docstring)."""

    def __init__(self, device: pykka.ActorRef[Any], copy: pykka.ActorRef[Any], cfg: PipelineConfig,
                 data: BatchData, inputs: list[PinnedBuffer]) -> None:
        self.device, self.copy, self.cfg, self.data, self.inputs = device, copy, cfg, data, inputs
        self.n = cfg.batch_bytes // 4
        self.tail = checksum_tail(self.n)
        self.out_bytes = self.tail + 8
        self.per_replay = lanes_for(cfg)
        self.hosts = [_host_buffer(device, self.out_bytes) for _ in range(cfg.depth)]
        self.kept = {index: _host_buffer(device, self.out_bytes) for index in {0, cfg.batches - 1}}
        # Each host output's running checksum as a one-element view of 64-bit unsigned ints,
        # made once (reading a memoryview's item is a third of reading a numpy one's).
        self.sums = {id(h): h.view()[self.tail:self.tail + 8].cast("Q") for h in [*self.hosts, *self.kept.values()]}
        self.groups: list[_Group] = self._new_groups()
        self.turn = 0  # the group that sends next
        self.todo: deque[int] = deque(range(cfg.batches))
        self.tally = Tally(data, self.kept)
        self.stale_retries = 0
        self.errors: list[str] = []
        self.rebuilt = False

    def _new_groups(self) -> list[_Group]:
        """The ring's slots in groups of ``per_replay``, each with its buffers (poisoned, as
        :mod:`.pipeline` says why) and its graph, recorded with lane ``k`` reading input ``k``."""
        groups = []
        k = self.per_replay
        for first in range(0, self.cfg.depth, k):
            lanes = [self._new_lane(s) for s in range(first, min(first + k, self.cfg.depth))]
            grid, block = launch_shape(self.n)
            stages: list[list[Stage]] = [[
                CopyToDevice(lane.inp, self.inputs[j]),
                Launch(SCALE_ADD_CHECKSUM_F32, grid, block, [Out(lane.out), In(lane.inp), ALPHA, BETA, self.n]),
                CopyToHost(lane.out, self.out_bytes, out=lane.host),
            ] for j, lane in enumerate(lanes)]
            graph = BatchGraph.record(self.device, stages)
            group = _Group(first, lanes, graph)
            groups.append(group)
            n = len(self.inputs) if len(lanes) > 1 else 0  # one lane: a node update is nothing beside its copies
            for at in range(n):
                bind: dict[Any, Any] = {self.inputs[j]: self.inputs[(at + j) % n] for j in range(len(lanes))}
                group.arranged[at] = graph.derive(bind)
        return groups

    def _new_lane(self, s: int) -> _Lane:
        inp: GpuRef = self.device.ask(Allocate(self.cfg.batch_bytes, tag=_INPUT), block=True)
        out: GpuRef = self.device.ask(Allocate(self.out_bytes, tag=_OUTPUT), block=True)
        self.copy.ask(Fill(inp, _POISON))
        self.copy.ask(Fill(out, _POISON))
        return _Lane(inp, out, self.hosts[s], bound_host=self.hosts[s])

    @property
    def done(self) -> int:
        return self.tally.done

    def _verify(self, group: _Group) -> None:
        """Wait for ``group``'s replay in flight and check what each of its batches added to its
        slot's running checksum (a spare lane's sum is taken as it is)."""
        done = group.done
        if done is None:
            return
        group.done = None
        done.wait()
        sums, kept, checksum = self.sums, self.kept, self.tally.checksum
        for lane in group.lanes:
            index, lane.batch = lane.batch, None  # None: a spare (every lane of a group replays)
            if index is None:
                lane.total = sums[id(lane.host)][0]
                continue
            total = sums[id(kept.get(index, lane.host))][0]
            checksum(index, lane.total, total)
            lane.total = total

    def step(self) -> None:
        """Send the next batches: verify the next group's replay in flight, then replay it with
        one batch a lane (a lane left without one, at the run's end, replays as a spare)."""
        group = self.groups[self.turn]
        self._verify(group)
        todo = self.todo
        indices = [todo.popleft() if todo else None for _ in group.lanes]
        at = self.cfg.rebuild_at
        if at is not None and at in indices and not self.rebuilt:
            self.rebuilt = True
            self.device.ask(Rebuild("demo: rebuild mid-pipeline (graph mode)"))
        try:
            graph, bind = self._replay_of(group, indices)
            group.done = graph.replay(bind)
        except GpuRefStale:
            sent = [i for i in indices if i is not None]
            self.stale_retries += len(sent)
            todo.extendleft(reversed(sent))
            self._after_rebuild()
            return
        for lane, index in zip(group.lanes, indices, strict=True):
            lane.batch = index
        self.turn = (self.turn + 1) % len(self.groups)

    def _replay_of(self, group: _Group, indices: list[int | None]) -> tuple[BatchGraph, dict[Any, Any] | None]:
        """What replays ``indices`` in ``group``: the usual replay (consecutive batches, none
        kept) is the group's graph derived for its first input, with nothing to bind; the rest
        (a kept batch, whose copy back lands in its own buffer, and the run's last replay with
        spare lanes) is the group's own graph, bound for it."""
        first = indices[0]
        if group.arranged and first is not None and indices == list(range(first, first + len(indices))) \
                and first not in self.kept and indices[-1] not in self.kept:  # the kept: the first and the last
            return group.arranged[first % len(self.inputs)], None
        return group.graph, self._binding(group, indices)

    def _binding(self, group: _Group, indices: list[int | None]) -> dict[Any, Any]:
        """What the group's own graph binds to replay ``indices``: each lane's batch's input
        and the buffer its copy back lands in (a kept batch's own, else the slot's), each named
        only when it changes (an unchanged binding costs nothing, but naming it costs a
        lookup)."""
        bind: dict[Any, Any] = {}
        inputs = self.inputs
        n = len(inputs)
        for j, (lane, index) in enumerate(zip(group.lanes, indices, strict=True)):
            host = lane.host if index is None else self.kept.get(index, lane.host)
            if host is not lane.bound_host:
                bind[lane.host] = lane.bound_host = host
            if index is not None:
                bind[inputs[j]] = inputs[index % n]
        return bind

    def _after_rebuild(self) -> None:
        """Every slot's handles are stale: verify what landed, run the rest again, on new slots."""
        for group in self.groups:
            in_flight = [lane.batch for lane in group.lanes if lane.batch is not None]
            try:
                self._verify(group)
            except XlogError:  # the copies back's event went with the context: run them again
                self.stale_retries += len(in_flight)
                self.todo.extendleft(reversed(in_flight))
        for group in self.groups:
            group.close()
        self.groups = self._new_groups()
        self.turn = 0

    def drain(self) -> None:
        """Verify every batch still in flight."""
        for group in self.groups:
            self._verify(group)

    def close(self) -> None:
        for group in self.groups:
            group.close()


def job_for(cfg: PipelineConfig) -> Callable[..., PipelineResult]:
    """The pipeline ``cfg`` asks for: :func:`run_graph_pipeline` with ``cfg.graph``, else the
    actors' :func:`.pipeline.run_pipeline` (both take the driver, the config, then ``ordinal``,
    ``progress``, ``start_gate`` and ``on_verified`` by keyword). Thread rule: any thread."""
    return run_graph_pipeline if cfg.graph else run_pipeline


def run_graph_pipeline(
    driver: Driver,
    cfg: PipelineConfig,
    ordinal: int = 0,
    progress: Callable[[int, int], None] | None = None,
    start_gate: Callable[[], None] | None = None,
    on_verified: Callable[[int], None] | None = None,
) -> PipelineResult:
    """Run the demo pipeline in graph mode (see the module docstring) and verify every batch.

    Args:
        driver: the driver to run on.
        cfg: the run's shape (``track``, ``producer_delay_us`` and ``fault_at`` do not apply: a
            graph's stages are ordered by the graph itself, and it plants no fault).
        ordinal: the device.
        progress: called with ``(done, total)`` about five times a second and at the end.
        start_gate: called once the inputs, buffers and graphs are made, just before the clock
            starts (a run on several devices waits there until every device is ready); called
            after a failed setup too, so that nobody waits for this run.
        on_verified: called with the batches verified so far as often as ``progress`` and at
            the end: a count that never takes in a batch not verified (a group's batches are
            verified in their order, and the groups in turn, so the count is a prefix).
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
        if start_gate is not None:
            start_gate()
        if run is not None:
            seconds, cpu = _drive(run, cfg, progress, on_verified)
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


def _drive(run: _GraphRun, cfg: PipelineConfig, progress: Callable[[int, int], None] | None,
           on_verified: Callable[[int], None] | None = None) -> tuple[float, float]:
    """Replay until every batch is sent, then verify the rest; (seconds, CPU seconds)."""
    t0, c0 = time.perf_counter(), time.process_time()
    deadline = t0 + cfg.timeout_s
    next_report = t0 + 0.2
    reports = progress is not None or on_verified is not None
    try:
        while run.todo and not run.errors:
            run.step()
            now = time.perf_counter()
            if reports and now >= next_report:
                _report(run, cfg, progress, on_verified)
                next_report = now + 0.2
            if now > deadline:
                run.errors.append(f"timed out after {cfg.timeout_s} s")
        run.drain()
    except XlogError as exc:
        run.errors.append(f"replay: {exc!r}")
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    if not run.errors:
        run.tally.compare_kept(cfg.batch_bytes)
    if reports:
        _report(run, cfg, progress, on_verified)
    return seconds, cpu


def _report(run: _GraphRun, cfg: PipelineConfig, progress: Callable[[int, int], None] | None,
            on_verified: Callable[[int], None] | None) -> None:
    if progress is not None:
        progress(run.done, cfg.batches)
    if on_verified is not None:
        on_verified(run.tally.verified)
