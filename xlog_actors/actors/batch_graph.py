"""``BatchGraph``: the stages of a batch declared once, recorded as one device graph, and replayed
per batch with one launch, tracked on the handles as the stages would have been one by one.

A batch of a pipeline is the same few stages every time (copy in, kernels, copy out), on the same
buffers or on buffers of the same sizes. Sent as library messages, each stage is a message hop
and a dozen driver calls' worth of Python; recorded as a graph (:mod:`..driver.graph`), the whole
batch is one ``cuGraphLaunch``. What the actors give, the graph keeps:

* **Handles are checked on every replay.** Each ``GpuRef`` the stages name is validated
  (``GpuRef.access``) before the launch: a stale or released handle raises ``GpuRefStale`` and
  nothing is launched. A graph belongs to the generation it was recorded in: after a rebuild
  every replay raises ``GpuRefStale`` (the driver's graph is released then), and the caller
  records a new one on the new generation's handles.
* **Tracking as if the stages ran one by one.** A replay runs on the graph's own stream of the
  device. Before the launch, that stream waits for what every handle's access needs (the last
  write of a handle read or written, the reads on other streams of a handle written:
  ``prepare_block_use``); after it, the uses are recorded (``finish_block_use``) and every
  handle a stage writes records the graph's stream as its last writer. A ``CopyActor`` or
  ``KernelActor`` outside the graph that uses one of the handles afterwards waits for exactly
  the replays it must; the stages inside the graph are ordered by the graph's chain itself.
* **Lanes.** Stages given as several lists are *lanes*: each list runs in its order, with no
  order between the lists, so the lanes of one replay may run at the same time on the device
  (several batches of a pipeline, each on its own buffers, in one launch: the launch's cost is
  paid once for all of them). No lane may write what another lane names: the recording and
  every binding refuse it with ``InvalidRequest``. The host driver runs the lanes one after the
  other, one valid schedule of them.
* **Bindings.** ``replay(bind)`` replaces operands (a ``GpuRef`` or ``PinnedBuffer`` a stage
  names) with others of the same kind, device and size, with one node update each
  (``cuGraphExecMemcpyNodeSetParams`` and kin). A binding stays until it is replaced (bind a
  recorded operand to itself to go back); an unchanged binding costs nothing. This is how one
  recorded graph serves a stream of batches whose host buffers differ.
* **Derived graphs.** ``derive(bind)`` records the same stages, bound otherwise, as a device
  graph of its own on the same stream: a program that turns over a few arrangements of its
  buffers replays one derived graph per arrangement and pays no node update at all.

Thread rule: any thread; replays of one graph are serialized by its lock. Recording asks the
device actor for its context, so it must not run on the device actor's own thread.

Why one module, longer than 400 lines: a replay and its bindings are one state under one lock
(the operands bound now, the driver graph's nodes, the host views the compiled core keeps), each
binding path checked and applied against all of it; the lanes' own rules live in
:mod:`.graph_lanes`, the stages' in :mod:`.graph_stages`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any, cast

import pykka

from .._core.graph_replay import GraphDone, ReplayCore
from ..driver.graph import Graph
from ..driver.protocol import Stream
from ..errors import DeviceUnavailable, GpuRefStale, InvalidRequest, XlogError
from ..memory.block import Access, StreamId
from ..memory.pinned import PinnedBuffer
from .device_actor import DeviceActor
from .device_context import DeviceContext
from .gpu_ref import GpuRef
from .graph_lanes import LaneIndex, check_apart, flatten
from .graph_stages import Operand, Slot, Stage, Views, check_operand, host_bytes, operands, step, view
from .library_messages import CopyToDevice, CopyToHost
from .messages import Attach
from .pykka_internals import is_actor_ref_of

__all__ = ["BatchGraph", "GraphDone", "HostBinding", "Stage"]

#: How many completion events a graph re-records in turn (see ``BatchGraph._done_event``).
_DONE_EVENTS = 64


class HostBinding:
    """Bindings of pinned buffers prepared once for one graph (:meth:`BatchGraph.host_binding`),
    replayed as often as wanted: ``graph.replay(binding)`` does what ``graph.replay(mapping)``
    does with the same mapping, with the checks of kind, device and size made once, and, once
    the graph has bound each buffer before, every node update made in one compiled call.

    Each replay that changes a buffer still updates its node; a pipeline that turns the same few
    arrangements over and over replays a graph derived for each (:meth:`BatchGraph.derive`).

    Thread rule: immutable for its user; its graph's lock serializes its use.
    """

    __slots__ = ("_entries", "_graph", "_mapping")

    def __init__(self, graph: BatchGraph, mapping: dict[Operand, Operand]) -> None:
        """Internal: use :meth:`BatchGraph.host_binding`."""
        self._graph = graph
        self._mapping = mapping
        #: [key, buffer, node, view, address] per binding; node None until the graph can take it
        #: by address alone (then the compiled call applies them all)
        self._entries: list[list[Any]] = [[id(k), v, None, None, 0] for k, v in mapping.items()]

    def __repr__(self) -> str:
        return f"HostBinding({len(self._mapping)} buffers, {self._graph!r})"


class BatchGraph:
    """A batch's stages recorded once as a graph of the device; see the module docstring.

    Make one with :meth:`record`; replay it with :meth:`replay`; release it with :meth:`close`
    (or let it be collected).

    Thread rule: any thread; one replay at a time per graph (its lock).
    """

    def __init__(self, ctx: DeviceContext, stages: tuple[Stage, ...], lanes: tuple[int, ...], slots: list[Slot],
                 graph: Graph, stream_id: StreamId, stream: Stream, track: bool,
                 bound: dict[int, Operand] | None = None) -> None:
        """Internal: use :meth:`record` or :meth:`derive` (``bound``: the operands the driver
        graph was recorded with, by recorded operand; None: the recorded ones)."""
        self._ctx = ctx
        self._stages = stages
        self._lanes = lanes
        self._slots = slots
        self._graph: Graph | None = graph
        self._stream_id = stream_id
        self._stream = stream
        self._lock = threading.Lock()
        self._track = track
        self._tracking = track and ctx.runtime.supports_block_use_tracking()
        # An untracked stack (the direct one) cannot order others after a replay: each replay is
        # then waited for before it returns, as a library actor does.
        self._synchronize = track and not self._tracking
        self._by_recorded: dict[int, Slot] = {}
        self._stages_of: dict[int, list[int]] = {}
        for slot in slots:
            self._by_recorded.setdefault(id(slot.recorded), slot)
            at = self._stages_of.setdefault(id(slot.recorded), [])
            if slot.stage not in at:
                at.append(slot.stage)
        #: id(recorded operand) -> what it is bound to now
        self._bound: dict[int, Operand] = {id(s.recorded): s.recorded for s in slots} if bound is None else bound
        #: With several lanes: who names what, so that no binding has a lane write what another names.
        self._lane_index = LaneIndex(slots, self._bound) if len(lanes) > 1 else None
        self._views: Views = {}
        #: (recorded operand id, buffer id) -> a pinned buffer check_operand found fit for it
        self._checked_host: dict[tuple[int, int], Operand] = {}
        #: (id(recorded operand), id(buffer)) -> (the buffer, the driver graph's node, the view,
        #: its address): the compiled binding of a host operand copied by one step, per buffer.
        self._fast_hosts: dict[tuple[int, int], tuple[PinnedBuffer, Any, memoryview, int]] = {}
        runtime = ctx.runtime
        # The replay itself is compiled (handle checks, waits, launch, uses, completion, last
        # writes in one call). Its completions are a ring of events re-recorded in turn, so a
        # replay creates no event; a GraphDone older than the ring waits for a later replay.
        self._core = ReplayCore(ctx.driver, ctx.ordinal, stream, stream_id,
                                runtime.prepare_block_use if self._tracking else None,
                                runtime.finish_block_use if self._tracking else None,
                                self._synchronize, _DONE_EVENTS)
        self._uses = self._merged_uses()
        self._core.set_uses(self._uses)

    # -- recording --------------------------------------------------------------------------------
    @classmethod
    def record(cls, device: pykka.ActorRef[Any], stages: Sequence[Stage] | Sequence[Sequence[Stage]], *,
               track: bool = True) -> BatchGraph:
        """Record ``stages`` as one graph of ``device``'s current generation.

        The stages are library messages, as a ``CopyActor`` or ``KernelActor`` takes them, run in
        their order by each replay, or several lists of them, the graph's lanes (see the module
        docstring):

        * ``CopyToDevice(ref, data)`` with ``data`` a ``PinnedBuffer`` (all of it is copied);
        * ``CopyToHost(ref, nbytes, out=buffer)`` into a ``PinnedBuffer``;
        * ``CopyDeviceToDevice(src, dst)`` within the device;
        * ``Fill(ref, byte)``;
        * ``Launch(kernel, grid, block, args)`` with ``In``/``Out``/``InOut`` buffer arguments.

        Args:
            device: the ``ActorRef`` of a running ``DeviceActor`` (in this process).
            stages: one or more stages, or one or more non-empty lists of stages (lanes).
            track: False switches the tracking off (tests and demonstrations of the hazards it
                prevents only): no waits before a replay, no uses and writes recorded after it.
        Returns:
            the graph, ready to replay.
        Raises:
            InvalidRequest: ``device`` is not a running ``DeviceActor``, no stages, a stage of
                another type, a malformed one (naming the stage and field), a pageable host
                buffer, a handle or buffer of another device, an empty lane, a lane writing what
                another lane names. Nothing is recorded.
            GpuRefStale: a handle is stale (or of an older generation than the device's).
            DriverError, ContextPoisoned, DeviceUnavailable: the device's.
        Thread rule: any thread but the device actor's own.
        """
        if not is_actor_ref_of(device, DeviceActor):
            raise InvalidRequest(f"BatchGraph.record needs the ActorRef of a running DeviceActor, got {device!r}")
        if not isinstance(stages, (list, tuple)) or not stages:
            raise InvalidRequest(f"BatchGraph.record: stages must be a non-empty list of stages, got {stages!r}")
        if not isinstance(track, bool):
            raise InvalidRequest(f"BatchGraph.record: track must be a bool, got {track!r}")
        flat, lanes = flatten(stages)
        try:
            ctx = cast(DeviceContext, device.ask(Attach()))
        except pykka.ActorDeadError as exc:
            raise DeviceUnavailable("BatchGraph.record: the DeviceActor was stopped") from exc
        slots: list[Slot] = []
        lane_of = [lane for lane, n in enumerate(lanes) for _ in range(n)]
        for i, stage in enumerate(flat):
            for slot in operands(i, stage, ctx):
                slot.lane = lane_of[i]
                slots.append(slot)
        for slot in slots:
            check_operand(slot.recorded, slot.recorded, ctx, slot.stage)
        if len(lanes) > 1:
            check_apart(slots)
        steps = [step(stage, {id(s.recorded): s.recorded for s in slots}, {}) for stage in flat]
        stream_id = ctx.runtime.stream_pool.acquire()
        stream = ctx.runtime.stream_pool.resolve(stream_id)
        assert stream is not None
        graph = ctx.driver.record_graph(ctx.ordinal, steps, None if len(lanes) == 1 else lanes)
        return cls(ctx, flat, lanes, slots, graph, stream_id, stream, track)

    # -- properties ---------------------------------------------------------------------------------
    @property
    def generation(self) -> int:
        """The generation the graph was recorded in. Thread rule: any thread."""
        return self._ctx.generation

    @property
    def stream_id(self) -> StreamId:
        """The graph's own stream, on which every replay runs. Thread rule: any thread."""
        return self._stream_id

    @property
    def stages(self) -> tuple[Stage, ...]:
        """The stages as recorded (bindings not applied), the lanes one after the other.
        Thread rule: any thread."""
        return self._stages

    @property
    def lanes(self) -> tuple[int, ...]:
        """Each lane's number of stages, in order (one lane of every stage when recorded from
        one list). Thread rule: any thread."""
        return self._lanes

    @property
    def closed(self) -> bool:
        """Whether the graph was closed (by :meth:`close`, or after its generation ended)."""
        return self._graph is None

    def host_binding(self, bind: Mapping[PinnedBuffer, PinnedBuffer]) -> HostBinding:
        """Prepare ``bind`` (recorded pinned buffer -> its replacement) for replays: see
        :class:`HostBinding`.

        Args:
            bind: recorded host operands (``PinnedBuffer`` s a stage names) to replacements of
                the same device and size, as :meth:`replay` takes them.
        Returns:
            the binding, for :meth:`replay` of this graph only.
        Raises:
            InvalidRequest: a key no stage names, a key or replacement that is not a
                ``PinnedBuffer``, another device or size, a released buffer, a closed graph.
                Whether a lane would write what another names is judged at each replay (the
                other bindings may change in between).
        Thread rule: any thread; serialized with the graph's replays.
        """
        with self._lock:
            if self._graph is None:
                raise InvalidRequest("BatchGraph.host_binding: the graph was closed")
            mapping: dict[Operand, Operand] = {}
            for recorded, new in bind.items():
                slot = self._by_recorded.get(id(recorded))
                if slot is None or slot.recorded is not recorded:
                    raise InvalidRequest(f"BatchGraph.host_binding: {recorded!r} is no operand of the graph")
                if not isinstance(recorded, PinnedBuffer):
                    raise InvalidRequest(f"BatchGraph.host_binding binds pinned buffers; {recorded!r} is a "
                                         f"{type(recorded).__name__} (bind it through a mapping)")
                check_operand(new, recorded, self._ctx, None)
                mapping[recorded] = new
            return HostBinding(self, mapping)

    def derive(self, bind: Mapping[Operand, Operand]) -> BatchGraph:
        """A graph of the same stages and lanes, bound as this one is now with ``bind`` applied,
        recorded as a device graph of its own that replays on this graph's stream.

        What it is for: a binding costs a node update per step it changes at every replay that
        changes it (about 1.5 µs of CPU each on an H100). A program that turns over a few
        arrangements of its buffers (a ring of inputs) derives one graph per arrangement and
        replays each without any update. The derived graph shares this one's stream, so the
        replays of both are ordered as if they were one graph's (a replay's tracking sees the
        same stream, and waits for nothing the other did); each has its own bindings and
        completions, and closing one leaves the other.

        Args:
            bind: recorded operand -> its replacement, as :meth:`replay` takes it.
        Returns:
            the new graph, ready to replay; this graph is unchanged.
        Raises:
            InvalidRequest: as :meth:`replay`'s binding (a key no stage names, a replacement of
                another kind, device or size, a released buffer, a lane that would write what
                another names), or a closed graph. Nothing is recorded.
            GpuRefStale: a handle is stale, or the device was rebuilt since recording.
            DriverError, ContextPoisoned: the device's.
        Thread rule: any thread but the device actor's own; serialized with this graph's replays.
        """
        with self._lock:
            self._live_graph("derive")
            ctx = self._ctx
            changed = self._changes(bind, "derive")
            bound = dict(self._bound)
            if changed and self._lane_index is not None:
                self._lane_index.check(changed, self._bound)
            bound.update(changed)
            for slot in self._slots:  # every handle as the replays will check it, before recording
                check_operand(bound[id(slot.recorded)], slot.recorded, ctx, slot.stage)
            steps = [step(stage, bound, {}) for stage in self._stages]
            lanes = self._lanes
            graph = ctx.driver.record_graph(ctx.ordinal, steps, None if len(lanes) == 1 else lanes)
            return BatchGraph(ctx, self._stages, lanes, self._slots, graph, self._stream_id, self._stream,
                              self._track, bound)

    # -- replay -------------------------------------------------------------------------------------
    def replay(self, bind: Mapping[Operand, Operand] | HostBinding | None = None) -> GraphDone:
        """Run every stage once, as one launch on the graph's stream, tracked on the handles.

        Args:
            bind: recorded operand -> its replacement, for this replay and the later ones (see
                the module docstring). A replacement is of the same kind (``GpuRef`` or
                ``PinnedBuffer``), of the same device and of exactly the same size. Or a
                :class:`HostBinding` of this graph: the same, prepared.
        Returns:
            a :class:`GraphDone` to wait on.
        Raises:
            GpuRefStale: a handle (recorded or bound) is stale or released, or the device was
                rebuilt since recording (the graph is closed then); nothing is launched.
            InvalidRequest: a key of ``bind`` that no stage names, a replacement of another kind,
                device or size, a released buffer, a replacement that would have a lane write
                what another lane names, a ``HostBinding`` of another graph, a closed graph;
                nothing changes.
            DriverError, ContextPoisoned: the device's.
        Thread rule: any thread; serialized with the graph's other replays.
        """
        with self._lock:
            graph = self._live_graph("replay")
            ctx = self._ctx
            if isinstance(bind, HostBinding):
                self._apply(bind, graph)
            elif bind:
                self._bind(bind, graph)
            core = self._core
            try:
                # Stale or released handles raise GpuRefStale before anything is enqueued.
                return core.replay(graph)
            except XlogError as exc:
                if not isinstance(exc, GpuRefStale) and not ctx.is_current():
                    self._close_locked()
                    raise GpuRefStale("context rebuilt", f"device {ctx.ordinal} was rebuilt during the replay") from exc
                raise

    def _apply(self, binding: HostBinding, graph: Graph) -> None:
        """A prepared binding: in one compiled call when every buffer it changes may go by
        address alone, else as its mapping; then the entries the graph can now take by address
        learn how (a written operand's never do: its lanes' index is kept here)."""
        if binding._graph is not self:
            raise InvalidRequest(f"BatchGraph.replay: {binding!r} was prepared for another graph")
        index = self._lane_index
        if self._core.apply_hosts(graph, binding._entries, self._bound, None if index is None else index.named):
            return
        self._bind(binding._mapping, graph)
        fast = self._fast_hosts
        for entry in binding._entries:
            if entry[2] is None and (index is None or entry[0] not in index.writers):
                hit = fast.get((entry[0], id(entry[1])))
                if hit is not None and hit[0] is entry[1]:
                    entry[2], entry[3], entry[4] = hit[1], hit[2], hit[3]

    def _bind(self, bind: Mapping[Operand, Operand], graph: Graph) -> None:
        """Check every replacement, then update the steps they change (nothing changes on a
        refused one)."""
        bound = self._bound
        changed = self._changes(bind, "replay")
        if not changed:
            return
        if self._lane_index is not None:
            self._lane_index.check(changed, self._bound)
        if not any(self._by_recorded[key].access is not None for key, _ in changed):
            # Host buffers only: each through the compiled core where it can, the rest through
            # the graph's own updates; all or nothing (a failure puts the fast ones back).
            fast: list[tuple[int, Operand]] = []
            try:
                rest = []
                for change in changed:
                    old = bound[change[0]]
                    if self._bind_fast(change, graph):
                        fast.append((change[0], old))
                    else:
                        rest.append(change)
                if rest:
                    self._bind_host(rest, graph)
            except BaseException:
                for key, old in reversed(fast):
                    with contextlib.suppress(XlogError):
                        self._bind_fast((key, old), graph)
                raise
            return
        before = dict(bound)
        devices = False
        stages: list[int] = []
        for key, new in changed:
            self._set_bound(key, new)
            devices = devices or self._by_recorded[key].access is not None
            for i in self._stages_of[key]:
                if i not in stages:
                    stages.append(i)
        try:
            for i in stages:
                graph.update(i, step(self._stages[i], bound, self._views), checked=True)
        except BaseException:
            bound.clear()
            bound.update(before)  # what the graph holds for the steps updated before: see below
            if self._lane_index is not None:
                self._lane_index.reindex(bound)
            for i in stages:  # put every step back as it was (each update is all or nothing)
                with contextlib.suppress(XlogError):
                    graph.update(i, step(self._stages[i], bound, self._views), checked=True)
            raise
        if devices:
            self._uses = self._merged_uses()
            self._core.set_uses(self._uses)

    def _live_graph(self, what: str) -> Graph:
        """The driver graph, when the graph is open and of the device's current generation; else
        ``InvalidRequest`` (closed) or ``GpuRefStale`` (rebuilt: the graph is closed then).
        ``what``: the method, for the error. Call under the lock."""
        graph = self._graph
        if graph is None:
            raise InvalidRequest(f"BatchGraph.{what}: the graph was closed")
        ctx = self._ctx
        if not ctx.is_current():
            self._close_locked()
            raise GpuRefStale("context rebuilt", f"device {ctx.ordinal}: the graph was recorded in "
                              f"generation {ctx.generation}; record it again on the new handles")
        return graph

    def _changes(self, bind: Mapping[Operand, Operand], what: str) -> list[tuple[int, Operand]]:
        """The replacements of ``bind`` that differ from the bindings of now, as (recorded
        operand's key, replacement), each checked (``InvalidRequest``, ``GpuRefStale``); nothing
        changes. ``what``: the method, for the error. Call under the lock."""
        ctx, bound = self._ctx, self._bound
        changed: list[tuple[int, Operand]] = []
        for recorded, new in bind.items():
            key = id(recorded)
            slot = self._by_recorded.get(key)
            if slot is None or slot.recorded is not recorded:
                raise InvalidRequest(f"BatchGraph.{what}: bind names {recorded!r}, which no stage of the graph names")
            if new is not bound[key]:
                # A pinned buffer already found fit for this operand needs only its release
                # checked again (its kind, device and size never change).
                checked = self._checked_host.get((key, id(new)))
                if checked is not new or cast(PinnedBuffer, new).released:
                    check_operand(new, recorded, ctx, None)
                    if isinstance(new, PinnedBuffer):
                        if len(self._checked_host) >= 256:  # bounded: ever new buffers
                            self._checked_host.clear()
                        self._checked_host[(key, id(new))] = new
                changed.append((key, new))
        return changed

    def _set_bound(self, key: int, new: Operand) -> None:
        """Bind recorded operand ``key`` to ``new``, keeping the lanes' index of memory written."""
        index = self._lane_index
        if index is not None and key in index.writers:
            index.moved(key, self._bound[key], new)
        self._bound[key] = new

    def _bind_fast(self, change: tuple[int, Operand], graph: Graph) -> bool:
        """One host buffer's binding (checked) through the compiled core, when its operand is
        copied by one step and the graph bound that step to the buffer's view before: the new
        address set on the node in C. False: nothing changed, take :meth:`_bind_host`."""
        key, new = change
        hit = self._fast_hosts.get((key, id(new)))
        if hit is None or hit[0] is not new:
            stages = self._stages_of[key]
            if len(stages) != 1:
                return False
            i = stages[0]
            buf = cast(PinnedBuffer, new)
            v = self._host_view(i, buf)
            found = graph.fast_host(i, v)
            if found is None:
                return False
            if len(self._fast_hosts) >= 256:  # bounded: ever new buffers
                self._fast_hosts.clear()
            hit = self._fast_hosts[(key, id(new))] = (buf, found[0], v, found[1])
        if not self._core.bind_host(graph, hit[1], hit[2], hit[3]):
            return False
        self._set_bound(key, new)
        return True

    def _bind_host(self, changed: list[tuple[int, Operand]], graph: Graph) -> None:
        """Bindings of host buffers only (checked): each of their copy steps gets the new
        buffer's view (``Graph.swap_host``, one node update each), and the views replaced ride
        on the next replay's completion until the launches before them ran; all or nothing."""
        bound, core = self._bound, self._core
        done: list[tuple[int, int, Operand]] = []
        try:
            for key, new in changed:
                for i in self._stages_of[key]:
                    replaced = graph.swap_host(i, self._host_view(i, cast(PinnedBuffer, new)))
                    if replaced is not None:
                        core.retire(replaced)
                    done.append((key, i, bound[key]))
                self._set_bound(key, new)
        except BaseException:
            for key, i, old in reversed(done):  # put the steps already updated back
                self._set_bound(key, old)
                with contextlib.suppress(XlogError):
                    replaced = graph.swap_host(i, self._host_view(i, cast(PinnedBuffer, old)))
                    if replaced is not None:
                        core.retire(replaced)
            raise

    def _host_view(self, i: int, buf: PinnedBuffer) -> memoryview:
        """The view of ``buf`` that host copy step ``i`` copies: all of it into the device, the
        step's byte count out of it."""
        stage = self._stages[i]
        nbytes = buf.nbytes if isinstance(stage, CopyToDevice) else host_bytes(cast(CopyToHost, stage))
        return view(buf, nbytes, self._views)

    def _merged_uses(self) -> list[tuple[GpuRef, Access]]:
        """One (handle, access) per distinct block bound now; read and written is READ_WRITE."""
        merged: dict[int, tuple[GpuRef, Access]] = {}
        for s in self._slots:
            if s.access is None:
                continue
            ref = cast(GpuRef, self._bound[id(s.recorded)])
            key = ref.block.ptr
            prev = merged.get(key)
            access = s.access if prev is None or prev[1] is s.access else Access.READ_WRITE
            merged[key] = (ref, access)
        return list(merged.values())

    # -- closing ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the device graph (replays already launched still run). Idempotent.
        Thread rule: any thread."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        graph, self._graph = self._graph, None
        if graph is not None:
            graph.close(self._core.take_kept())

    def __repr__(self) -> str:
        lanes = f", lanes={len(self._lanes)}" if len(self._lanes) > 1 else ""
        state = " closed" if self._graph is None else ""
        return (f"BatchGraph(device={self._ctx.ordinal}, generation={self._ctx.generation}, "
                f"stages={len(self._stages)}{lanes}{state})")

