# cython: language_level=3, boundscheck=False, wraparound=False
"""The compiled replay of a ``BatchGraph``: validate its handles, queue the waits their tracking
asks, launch the graph, record the uses, the completion and the last writes, in one call.

A replay is the same dozen steps every batch. In Python each step is a few frames (the handle's
check, the resource's bound methods, the graph's lock and the stream's gate, the event's record)
and together they cost more than the driver calls they make. Here the loop over the handles is
C, the handle check reads ``HandleCore``'s C fields, and the launch, the completion's record and
its query go through :class:`~xlog_actors._core.ops.DriverOps`: on CUDA the ``libcuda`` entry
points with the GIL kept (one call each while the stream, the event and the graph are of the
current epoch), on any other driver the driver's Python methods. The tracking itself stays the
resource's (``prepare_block_use`` / ``finish_block_use``, whatever adaptors wrap it).

Invariants: the uses (handle, access) are set by the owner (``set_uses``) and read by ``replay``;
the owner serializes both, and the graph's updates and close, under its own lock (``BatchGraph``).
Nothing is launched unless every handle validated and every wait was queued. The completion
events are a ring of ``ring`` events re-recorded in turn, created on first use.

Host views a rebinding replaced (``retire``) may still be read or written by the launches before
it, so they are kept until those ran, without an event of their own: they ride on the next
replay's completion event (recorded after a launch that comes after all of them on the stream).
When the ring comes back to that event, one query says whether it fired: then they are let go,
else they ride on the next one. ``take_kept`` hands whatever is still kept to the graph's close.

Thread rule: any thread, one call at a time per core (the owner's lock).
"""

from cpython.weakref cimport PyWeakref_GetObject

from .async_core cimport AsyncCore
from .handles cimport HandleCore
from .ops cimport DriverOps, ops_for

__all__ = ["GraphDone", "ReplayCore"]


cdef class ReplayCore


cdef class GraphDone:
    """The completion of one replay: an event recorded on the graph's stream right after it.

    A graph re-records a ring of 64 events in turn, so a ``GraphDone`` kept past 64 later
    replays of its graph stands for a later replay: it then waits longer, never less.

    Made by ``BatchGraph.replay`` only (a compiled object: a replay makes one, so it costs a
    tenth of what a Python object would). Immutable.

    Fields: ``event``, the driver event (a stream of the same driver may wait on it).

    Thread rule: any thread; several threads may wait on one.
    """

    cdef readonly object event
    cdef ReplayCore _core

    def __init__(self, *args, **kwargs):
        raise TypeError("GraphDone is made by BatchGraph.replay")

    def done(self):
        """Whether the replay ran; never blocks.

        Raises:
            DriverError: the context was rebuilt before the replay was seen to complete.
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread.
        """
        return self._core._ops.query(self.event)

    def wait(self):
        """Block until the replay ran (its copies to the host have landed).

        Raises:
            DriverError: the context was rebuilt before the replay was seen to complete.
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread.
        """
        # A replay already done (the usual case for a ring's oldest) answers a query, which keeps
        # the GIL; the synchronize would let it go and take it back.
        if not self._core._ops.query(self.event):
            self.event.synchronize()

    def __repr__(self):
        return f"GraphDone(event={self.event!r})"


cdef class ReplayCore:
    """The per-graph state of the compiled replay (see the module docstring).

    Thread rule: any thread; the owner serializes every call.
    """

    cdef DriverOps _ops
    cdef object _stream
    cdef object _sid
    cdef object _prepare
    cdef object _finish
    cdef AsyncCore _tracker  # the compiled resource whose own tracking prepare/finish are, or None
    cdef tuple _refs
    cdef tuple _accesses
    cdef tuple _written
    cdef list _events
    cdef list _riders
    cdef list _retired
    cdef Py_ssize_t _done_at
    cdef Py_ssize_t _ring
    cdef bint _synchronize

    def __init__(self, driver, ordinal, stream, stream_id, prepare, finish, bint synchronize, Py_ssize_t ring):
        """Args:
            driver: the device's driver.
            ordinal: the device's ordinal.
            stream: the driver stream every replay runs on.
            stream_id: its ``StreamId`` (what the handles' uses and last writes record).
            prepare, finish: the resource's ``prepare_block_use`` / ``finish_block_use``, or None
                for both when the replay is not tracked.
            synchronize: wait for each replay before returning (an untracked resource's rule).
            ring: how many completion events to re-record in turn (at least 1).
        Raises:
            ValueError: ``ring`` < 1, or only one of ``prepare``/``finish`` given.
        """
        if ring < 1:
            raise ValueError(f"ReplayCore: ring must be at least 1, got {ring}")
        if (prepare is None) != (finish is None):
            raise ValueError("ReplayCore: prepare and finish are given together or not at all")
        self._ops = ops_for(driver, ordinal)
        self._stream = stream
        self._sid = stream_id
        self._prepare = prepare
        self._finish = finish
        # The stack's tracking is the compiled resource's own (no adaptor in between): every
        # block of a replay is then tracked in one call each way, the lock taken once.
        owner = getattr(prepare, "__self__", None)
        self._tracker = None
        if (isinstance(owner, AsyncCore) and getattr(finish, "__self__", None) is owner
                and getattr(prepare, "__func__", None) is getattr(type(owner), "prepare_block_use", None)
                and getattr(finish, "__func__", None) is getattr(type(owner), "finish_block_use", None)):
            self._tracker = <AsyncCore>owner
        self._synchronize = synchronize
        self._ring = ring
        self._events = []
        self._riders = []
        self._retired = []
        self._done_at = 0
        self._refs = ()
        self._accesses = ()
        self._written = ()

    def set_uses(self, uses):
        """Set what every later replay validates and tracks.

        Args:
            uses: ``(handle, access)`` pairs, one per distinct block; ``access.writes`` says
                whether the replay writes it (its last write is then the graph's stream).
        """
        refs = tuple(ref for ref, _ in uses)
        accesses = tuple(access for _, access in uses)
        self._written = tuple(ref for ref, access in uses if access.writes)
        self._refs = refs
        self._accesses = accesses

    def replay(self, graph):
        """One replay of ``graph`` on the core's stream, tracked.

        Args:
            graph: the driver's graph (``Graph``) to launch.
        Returns:
            a ``GraphDone`` of the completion event, recorded right after the launch.
        Raises:
            GpuRefStale: a handle is stale or released; nothing was enqueued.
            DriverError, ContextPoisoned, and the tracking's errors: the driver's and the
                resource's, as their Python paths raise them.
        """
        cdef HandleCore core
        cdef Py_ssize_t i, n
        refs = self._refs
        n = len(refs)
        blocks = []  # each handle's block, as its check returned it
        for i in range(n):
            ref = refs[i]
            if isinstance(ref, HandleCore):
                core = <HandleCore>ref
                if (core._cell.token is core._token and not core._released
                        and <object>PyWeakref_GetObject(core._state) is not None):
                    blocks.append(core._block)
                    continue
            blocks.append(ref.access())  # the slow path: refreshes a moved token, or raises GpuRefStale
        sid, stream = self._sid, self._stream
        accesses = self._accesses
        tracker = self._tracker
        prepare = self._prepare
        if tracker is not None:
            tracker.use_blocks(blocks, sid, accesses, False)
        elif prepare is not None:
            for i in range(n):
                prepare(blocks[i], sid, accesses[i])
        self._ops.graph_launch(graph, stream)
        finish = self._finish
        if tracker is not None:
            tracker.use_blocks(blocks, sid, accesses, True)
        elif finish is not None:
            for i in range(n):
                finish(blocks[i], sid, accesses[i])
        event = self._done_event()
        if self._synchronize:
            stream.synchronize()
        for ref in self._written:
            if isinstance(ref, HandleCore):
                (<HandleCore>ref)._last_write = sid
            else:
                ref.record_write(sid)
        cdef GraphDone done = GraphDone.__new__(GraphDone)
        done.event = event
        done._core = self
        return done

    cdef object _done_event(self):
        """The next event of the ring, recorded now on the stream, with the views retired since
        the last replay riding on it (see the module docstring)."""
        cdef Py_ssize_t at
        events = self._events
        retired = self._retired
        if len(events) < self._ring:
            event = self._ops.create_event()
            self._ops.record(event, self._stream)
            events.append(event)
            self._riders.append(retired)
            self._retired = []
            return event
        at = self._done_at
        event = events[at]
        riding = self._riders[at]
        if riding and not self._ops.query(event):
            retired.extend(riding)  # their launches may not have run yet: on to the next event
        self._ops.record(event, self._stream)
        self._riders[at] = retired
        self._retired = []
        self._done_at = (at + 1) % self._ring
        return event

    def bind_host(self, graph, node, view, unsigned long long address):
        """Bind host copy node ``node`` of ``graph`` (a ``CudaGraph``'s, from its ``fast_host``)
        to ``view`` at ``address``, checked by the caller (pinned, of the step's length), in C:
        the address written into the node's kept parameters and set on the exec; the replaced
        view rides on the next completion.

        Returns:
            True when done (or ``view`` is the node's already); False when the graph has no such
            path now (closed, another epoch, another driver): nothing changed, and the caller
            takes ``Graph.swap_host``.
        Raises:
            DriverError, ContextPoisoned: the driver refused the update; nothing changed.
        """
        return self._bind_one(graph, node, view, address)

    cdef bint _bind_one(self, object graph, object node, object view, unsigned long long address) except -1:
        replaced = node.keep
        if replaced is view:
            return True
        if not self._ops.graph_host_set(graph, node, address):
            return False
        node.keep = view
        a = node.addresses
        node.addresses = (address, 0, 0, a[3]) if node.src else (0, a[1], address, 0)
        if replaced is not None:
            self._retired.append(replaced)
        return True

    def apply_hosts(self, graph, list entries, dict bound, dict named):
        """Apply a prepared binding of host buffers (``HostBinding``'s entries) in C, when every
        entry that changes something may go by address alone.

        Args:
            graph: the driver's graph (``CudaGraph``).
            entries: lists ``[key, buffer, node, view, address]``: the recorded operand's key in
                ``bound``, its new buffer (checked when the binding was made), and the copy
                node, the buffer's view and its address from the graph's ``fast_host`` (node
                None until known: then this returns False).
            bound: the graph's bindings (key -> operand), updated here for what is applied.
            named: the memory that written operands are bound to (id -> keys), or None without
                lanes: a buffer found there goes to the Python path, which judges the conflict.
        Returns:
            True when every entry is applied (or was already); False when one needs the Python
            path: the entries before it that passed the checks may be applied, the rest not
            (the caller's mapping path finds those unchanged and does the rest).
        Raises:
            DriverError, ContextPoisoned: the driver refused an update.
        Thread rule: the owner's lock (as ``replay``).
        """
        cdef Py_ssize_t i, n = len(entries)
        cdef list entry
        for i in range(n):  # everything checked before anything is applied
            entry = <list>entries[i]
            new = entry[1]
            if bound[entry[0]] is new:
                continue
            if entry[2] is None or new.released or (named is not None and id(new) in named):
                return False
        for i in range(n):
            entry = <list>entries[i]
            new = entry[1]
            if bound[entry[0]] is new:
                continue
            if not self._bind_one(graph, entry[2], entry[3], entry[4]):
                return False
            bound[entry[0]] = new
        return True

    def retire(self, view):
        """Keep ``view`` (a host view a rebinding replaced) until the launches before now ran."""
        self._retired.append(view)

    def take_kept(self):
        """Everything still kept (retired views, riding or not), handed over and forgotten: for
        the graph's close, which keeps them until the launches already enqueued ran."""
        kept = list(self._retired)
        for riders in self._riders:
            kept.extend(riders)
        self._retired = []
        self._riders = [[] for _ in self._riders]
        return kept

    def query(self, event):
        """Whether the work before ``event``'s latest record ran; never blocks.

        Args:
            event: a completion event this core returned.
        Returns:
            True once it ran.
        Raises:
            DriverError: the context was rebuilt. ContextPoisoned: the device saw a sticky error.
        """
        return self._ops.query(event)
