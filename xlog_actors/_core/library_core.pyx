# cython: language_level=3, boundscheck=False, wraparound=False
"""A library actor's common work in one call: validate the handles, queue the waits their
tracking asks, enqueue the fill, the pinned copy or the kernel launch, record the uses and the
last writes.

Most library messages touch one handle (a fill, a copy in from a pinned buffer, a copy back into
one). In Python each of their steps is a few frames: the handle's check, the resource's bound
methods, the driver's stream gate and context check, its pinned-memory lookup, the keep-alive
event of a host copy and its lock. Here the steps are one C call: the handle check reads
``HandleCore``'s C fields, the buffer check reads the ``PinnedBuffer``'s slots, the enqueue goes
through :class:`~xlog_actors._core.ops.DriverOps` (on CUDA the ``libcuda`` entry points with the
GIL kept), and the tracking stays the resource's (``prepare_block_use`` / ``finish_block_use``).

A call answers False, having done nothing, when its operands are not the plain case: a handle that
is not a live handle of the core's context, a context that closed, a buffer released or of
another device, a launch whose kernel and dimensions have not yet been launched through the
Python path (:meth:`EnqueueCore.learn`), an argument its slot does not take as is, a handle passed
twice. The actor then takes its Python path, which raises the precise error.

**Launches.** A launch's kernel, grid and block (plain ints) are learned once the Python path
launched them: that path judged the dimensions against the device's limits and loaded the kernel.
Later launches of the same triple pack their arguments here, each into its 8-byte slot as the
driver packs them (a pointer, an integer of its kind's range, a real number), and call
``cuLaunchKernel`` through the ops, which go to the driver's method where the kernel is not loaded
in the current epoch.

**Host memory kept until the copy ran.** A copy from or into a pinned buffer that went straight to
``libcuda`` reads or writes the buffer's memory after the call returns, so the memory's owner (the
``_PinnedMemory`` every view of the buffer holds) is kept here, with an event recorded after the
copy, until that event fired: a ``release()`` of the buffer meanwhile frees nothing early. A copy
back shares the event its ``CopyDone`` carries; those events are re-recorded in turn once nothing
but the core holds them (a ``CopyDone`` dropped, with every reference to its event), so a copy back
does not create one. Kept owners are let go, oldest first, as later
copies find their events fired (a copy looks once more than ``_KEEP_SLACK`` are kept: a look is
an event query, and the events of one stream fire in order, so one query can let many go) and when the actor's Python path ran (:meth:`EnqueueCore.prune`:
a copy to pageable memory waits for the stream, so everything before it ran), as the driver's
streams let go of theirs; :meth:`EnqueueCore.close` waits for the rest (the stream's
context, when it is gone, was synchronized by its rebuild, which ran every copy). A copy the
driver's Python method ran is kept by the driver itself.

Invariants: nothing is enqueued unless the handle and the buffer validated and the waits were
queued; a handle written is recorded as last written on the core's stream after its work was
enqueued, as ``LibraryActor._run`` records it.

Why one module, longer than 400 lines: the fill, the two pinned copies and the launch share the
handle check, the tracking order and the kept host memory, and each must be read beside the
invariants above; the launch's argument packing is most of the length.

Thread rule: one call at a time per core (the owning actor's ``exclusive`` lock).
"""

from collections import deque

from cpython.ref cimport Py_REFCNT
from cpython.weakref cimport PyWeakref_GetObject
from libc.string cimport memcpy

from .context_core cimport ContextCore
from .handles cimport HandleCore
from .ops cimport DriverOps, ops_for

__all__ = ["KEEP_SLACK", "EnqueueCore"]

#: Marker events kept for reuse once their copies ran.
cdef Py_ssize_t _SPARE = 32
#: Kept owners a copy leaves before it looks for ones to let go: a look costs an event query, so
#: it is made once per this many copies, not per copy (the memory is kept that much longer).
KEEP_SLACK = 8
cdef Py_ssize_t _KEEP_SLACK = KEEP_SLACK
#: The most ``CopyDone`` events a core re-records in turn.
cdef Py_ssize_t _DONE_RING = 64
#: The most parameters a compiled launch packs (more take the Python path), and the most
#: (kernel, grid, block) triples a core learns.
DEF _MAX_PARAMS = 32
cdef Py_ssize_t _MAX_PLANS = 256

#: Parameter kinds as the packing loop reads them.
cdef dict _KIND_CODES = {"ptr": 0, "u64": 1, "i64": 2, "u32": 3, "i32": 4, "f32": 5, "f64": 6}
cdef double _F32_MAX = 3.4028234663852886e38


cdef class EnqueueCore:
    """One library actor's compiled enqueue in one attached context (see the module docstring).

    Thread rule: the owning actor serializes every call.
    """

    cdef DriverOps _ops
    cdef readonly object context
    cdef ContextCore _ctx
    cdef object _driver
    cdef object _ordinal
    cdef object _stream
    cdef object _sid
    cdef object _prepare
    cdef object _finish
    cdef object _read
    cdef object _write
    cdef type _pinned_type
    cdef object _kept
    cdef list _spare
    cdef list _done
    cdef Py_ssize_t _done_at
    cdef type _buffer_arg_type
    cdef dict _plans
    cdef unsigned long long _slots[_MAX_PARAMS]
    cdef void* _params[_MAX_PARAMS]
    cdef unsigned int _dims[6]

    def __init__(self, context, stream, stream_id, prepare, finish, read, write, type pinned_type,
                 type buffer_arg_type):
        """Args:
            context: the attached ``DeviceContext`` (a ``ContextCore``): only its handles are
                served, and only while it is open.
            stream: the actor's driver stream in that context.
            stream_id: its ``StreamId`` (what uses and last writes record).
            prepare, finish: the resource's ``prepare_block_use`` / ``finish_block_use``.
            read, write: ``Access.READ`` and ``Access.WRITE``.
            pinned_type: ``PinnedBuffer``: the only host buffer type the copies take.
            buffer_arg_type: ``BufferArg``: a launch's buffer arguments (``In``/``Out``/``InOut``).
        Raises:
            TypeError: ``context`` is not a ``ContextCore``.
        Thread rule: any thread.
        """
        self.context = context
        self._ctx = <ContextCore?>context
        self._driver = context.driver
        self._ordinal = context.ordinal
        self._ops = ops_for(self._driver, self._ordinal)
        self._stream = stream
        self._sid = stream_id
        self._prepare = prepare
        self._finish = finish
        self._read = read
        self._write = write
        self._pinned_type = pinned_type
        self._kept = deque()
        self._spare = []
        self._done = []
        self._done_at = 0
        self._buffer_arg_type = buffer_arg_type
        self._plans = {}
        cdef Py_ssize_t i
        for i in range(_MAX_PARAMS):
            self._params[i] = <void*>&self._slots[i]

    cdef object _block(self, object ref):
        """``ref``'s block when it is a live, unreleased handle of the core's open context, else
        None (the caller's Python path raises the precise error)."""
        cdef HandleCore core
        if not isinstance(ref, HandleCore) or not self._ctx.open:
            return None
        core = <HandleCore>ref
        if (core._context is not self.context or core._cell.token is not core._token or core._released
                or <object>PyWeakref_GetObject(core._state) is None):
            return None
        return core._block

    cdef object _owner(self, object buf):
        """``buf``'s memory owner when it is an unreleased ``PinnedBuffer`` of the core's device
        and driver, else None."""
        if type(buf) is not self._pinned_type:
            return None
        owner = buf._owner
        if owner is None or buf._driver is not self._driver or buf._ordinal != self._ordinal:
            return None
        return owner

    def fill(self, ref, int byte):
        """``Fill(ref, byte)``: every byte of ``ref``'s block set to ``byte``, tracked as a write.

        Args:
            ref: the handle.
            byte: 0..255 (the caller checked it).
        Returns:
            True when done; False when nothing was done (see the module docstring).
        Raises:
            ContextLost, ContextPoisoned, DriverError, and the tracking's errors: as the Python
                path raises them.
        """
        block = self._block(ref)
        if block is None:
            return False
        self._ops.check_context()
        sid, stream, write = self._sid, self._stream, self._write
        self._prepare(block, sid, write)
        self._ops.memset_d8(block.ptr, byte, block.nbytes, stream)
        self._finish(block, sid, write)
        (<HandleCore>ref)._last_write = sid
        return True

    def to_device(self, ref, buf):
        """``CopyToDevice(ref, buf)`` from a pinned buffer: all of ``buf`` into the start of
        ``ref``'s block, tracked as a write.

        Args:
            ref: the handle.
            buf: the ``PinnedBuffer``.
        Returns:
            True when done; False when nothing was done (also when ``buf`` does not fit).
        Raises:
            as :meth:`fill`.
        """
        owner = self._owner(buf)
        block = self._block(ref)
        if owner is None or block is None:
            return False
        nbytes = buf._nbytes
        if nbytes > block.nbytes:
            return False
        self._ops.check_context()
        sid, stream, write = self._sid, self._stream, self._write
        self._prepare(block, sid, write)
        if self._ops.copy_htod(block.ptr, buf, owner._ptr, nbytes, stream):
            self._keep(owner, None)
        self._finish(block, sid, write)
        (<HandleCore>ref)._last_write = sid
        return True

    def to_host(self, ref, buf, nbytes):
        """``CopyToHost(ref, nbytes, out=buf)``: the first ``nbytes`` of ``ref``'s block into the
        start of ``buf``, tracked as a read, with an event recorded after the copy.

        Args:
            ref: the handle.
            buf: the ``PinnedBuffer``.
            nbytes: 1..the handle's size (the caller checked it).
        Returns:
            the event recorded after the copy (the ``CopyDone``'s); None when nothing was done
            (also when ``buf`` is smaller than ``nbytes``).
        Raises:
            as :meth:`fill`.
        """
        owner = self._owner(buf)
        block = self._block(ref)
        if owner is None or block is None or nbytes > buf._nbytes or nbytes > block.nbytes:
            return None
        self._ops.check_context()
        sid, stream, read = self._sid, self._stream, self._read
        self._prepare(block, sid, read)
        fast = self._ops.copy_dtoh(buf, owner._ptr, block.ptr, nbytes, stream)
        try:
            event = self._done_event()
        except BaseException:
            if fast:
                self._keep(owner, None)  # the copy is enqueued: its memory stays until it ran
            raise
        if fast:
            self._keep(owner, event)
        self._finish(block, sid, read)
        return event

    def learn(self, kernel, grid, block, dims):
        """Take later launches of ``kernel`` with this ``grid`` and ``block`` (plain ints) on the
        compiled path: the Python path launched them, judging the dimensions and loading the
        kernel.

        Args:
            kernel: the ``Kernel``.
            grid, block: the ints the launch gave.
            dims: ``((gx, gy, gz), (bx, by, bz))`` as the launch checks returned them.
        Returns:
            True when learned (or known); False when not (a parameter kind or count it does not
            pack, dimensions that are not plain ints, the table full).
        """
        if type(grid) is not int or type(block) is not int:
            return False
        key = (kernel, grid, block)
        if key in self._plans:
            return True
        params = kernel.params
        if len(params) > _MAX_PARAMS or len(self._plans) >= _MAX_PLANS:
            return False
        codes = []
        for kind in params:
            code = _KIND_CODES.get(kind)
            if code is None:
                return False
            codes.append(code)
        (gx, gy, gz), (bx, by, bz) = dims
        self._plans[key] = (bytes(codes), (gx, gy, gz, bx, by, bz))
        return True

    def launch(self, msg):
        """``Launch(kernel, grid, block, args)`` of a learned triple (see :meth:`learn`): the
        buffer arguments validated and tracked as their access says, the arguments packed, the
        kernel launched, the handles written recorded.

        Args:
            msg: the ``Launch``.
        Returns:
            True when done; False when nothing was done (see the module docstring).
        Raises:
            as :meth:`fill`.
        """
        cdef Py_ssize_t i, n, nbuf
        cdef unsigned long long* slots = self._slots
        cdef unsigned int* dims = self._dims
        cdef bytes codes
        cdef unsigned char code
        cdef double real
        cdef float single
        cdef long long whole
        grid, block = msg.grid, msg.block
        if type(grid) is not int or type(block) is not int:
            return False
        kernel = msg.kernel
        try:
            plan = self._plans.get((kernel, grid, block))
        except TypeError:  # an unhashable kernel: not one the Python path would take either
            return False
        if plan is None:
            return False
        args = msg.args
        if type(args) is not list and type(args) is not tuple:
            return False
        codes = plan[0]
        n = len(codes)
        if len(args) != n:
            return False
        blocks = []
        refs = []
        accesses = []
        for i in range(n):
            value = args[i]
            code = codes[i]
            if code == 0:
                if type(value) is not self._buffer_arg_type:
                    return False
                ref = value.ref
                found = self._block(ref)
                if found is None:
                    return False
                for other in refs:
                    if other is ref:
                        return False  # passed twice: the Python path merges its uses
                refs.append(ref)
                blocks.append(found)
                accesses.append(value.access)
                slots[i] = <unsigned long long>found.ptr
            elif code == 5 or code == 6:
                if type(value) is not float and type(value) is not int:
                    return False
                try:
                    real = <double>value
                except OverflowError:
                    return False
                if code == 6:
                    memcpy(&slots[i], &real, 8)
                else:
                    if real > _F32_MAX or real < -_F32_MAX:
                        return False  # the Python path saturates it as numpy does
                    single = <float>real
                    slots[i] = 0
                    memcpy(&slots[i], &single, 4)
            else:
                if type(value) is not int:
                    return False
                if code == 1:
                    if value < 0 or value > 0xFFFFFFFFFFFFFFFF:
                        return False
                    slots[i] = <unsigned long long>value
                elif code == 2:
                    if value < -0x8000000000000000 or value > 0x7FFFFFFFFFFFFFFF:
                        return False
                    whole = <long long>value
                    memcpy(&slots[i], &whole, 8)
                elif code == 3:
                    if value < 0 or value > 0xFFFFFFFF:
                        return False
                    slots[i] = <unsigned long long>value
                else:
                    if value < -0x80000000 or value > 0x7FFFFFFF:
                        return False
                    whole = <long long>value
                    slots[i] = <unsigned long long>(<unsigned int>(<int>whole))
        d = plan[1]
        for i in range(6):
            dims[i] = <unsigned int>d[i]
        self._ops.check_context()
        sid, stream = self._sid, self._stream
        prepare, finish = self._prepare, self._finish
        nbuf = len(blocks)
        for i in range(nbuf):
            prepare(blocks[i], sid, accesses[i])
        if not self._ops.launch(kernel, dims, self._params, stream):
            self._driver.launch(kernel, grid, block, self._values(args, codes, blocks), stream)
        for i in range(nbuf):
            finish(blocks[i], sid, accesses[i])
        for i in range(nbuf):
            if accesses[i].writes:
                (<HandleCore>refs[i])._last_write = sid
        return True

    cdef object _values(self, object args, bytes codes, list blocks):
        """The launch's arguments as the driver's method takes them: each buffer argument as its
        block's pointer."""
        values = list(args)
        cdef Py_ssize_t i, at = 0
        for i in range(len(codes)):
            if codes[i] == 0:
                values[i] = blocks[at].ptr
                at += 1
        return values

    cdef object _done_event(self):
        """An event recorded now on the stream, for a ``CopyDone``: the ring's next one when
        nothing but the ring holds it any more (its ``CopyDone`` and every wait on it are gone, so
        no one can see it move), else a new one, added to the ring while it has room."""
        done = self._done
        cdef Py_ssize_t n = len(done)
        if n:
            event = done[self._done_at]
            if Py_REFCNT(event) != 2 and self._kept:
                self._prune(0)  # a kept copy that ran lets go of its event too
            if Py_REFCNT(event) == 2:  # the ring's reference and this one
                self._ops.record(event, self._stream)
                self._done_at = (self._done_at + 1) % n
                return event
            del event
        event = self._ops.create_event()
        self._ops.record(event, self._stream)
        if n < _DONE_RING:
            done.append(event)
        return event

    cdef _keep(self, object owner, object event):
        """Keep ``owner`` until the stream ran past now: ``event`` when given (recorded right
        after the copy), else a marker event recorded here. Owners whose events fired are let go
        on the way, so the queue is as long as the copies in flight. Where no marker can be
        recorded (the context failed), the stream is waited for instead, as the driver does."""
        cdef list spare = self._spare
        kept = self._kept
        if event is None:
            marker = spare.pop() if spare else None
            try:
                if marker is None:
                    marker = self._ops.create_event()
                self._ops.record(marker, self._stream)
            except BaseException:
                try:
                    self._stream.synchronize()
                except BaseException:
                    pass  # a failed context: its rebuild synchronizes before anything is freed
                raise
            kept.append((marker, owner, True))
        else:
            kept.append((event, owner, False))
        if len(kept) > _KEEP_SLACK:
            self._prune(1)

    cdef _prune(self, Py_ssize_t leave):
        """Let go of the kept owners whose copies ran, oldest first, leaving at least ``leave``
        (the newest, just recorded, has not run). Every kept event was recorded on the core's
        one stream, so they fire in order: when the newest that may go has fired, all before it
        have, and one query lets them all go."""
        cdef list spare = self._spare
        kept = self._kept
        cdef Py_ssize_t i, n = len(kept) - leave
        if n > 1 and self._ops.query(kept[n - 1][0]):
            for i in range(n):
                mark, _, ours = kept.popleft()
                if ours and len(spare) < _SPARE:
                    spare.append(mark)
            return
        while len(kept) > leave:
            mark, _, ours = kept[0]
            if not self._ops.query(mark):
                break
            kept.popleft()
            if ours and len(spare) < _SPARE:
                spare.append(mark)

    def prune(self):
        """Let go of the kept owners whose copies ran (after the actor waited for its stream, or
        any time).

        Raises:
            DriverError, ContextPoisoned: an event's context failed (nothing is let go then).
        """
        if self._kept:
            self._prune(0)

    def kept(self):
        """How many host buffers' memory is kept for copies that may not have run yet."""
        return len(self._kept)

    def close(self):
        """Let the kept memory go once its copies ran: wait for the stream when anything is
        kept and its context still lives (a rebuilt context was synchronized by its rebuild).

        Raises:
            nothing: a failed wait means a failed context, whose rebuild waits for every copy.
        """
        if self._kept and self._ctx.open:
            try:
                self._stream.synchronize()
            except BaseException:
                pass  # the context failed: its rebuild synchronizes before anything is freed
        self._kept.clear()
        self._spare = []
        self._done = []
