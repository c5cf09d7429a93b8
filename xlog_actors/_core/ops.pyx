# cython: language_level=3, boundscheck=False, wraparound=False
"""The driver calls the compiled resources make, behind one small interface.

* :class:`DriverOps` calls the driver protocol's Python methods: the host driver, and any driver
  that offers no entry points. It is also every other class's slow path.
* :class:`CudaOps` calls ``libcuda`` through function pointers the CUDA driver resolved with
  ``cuGetProcAddress`` (``CudaDriver.entry_points()``), so the build needs no ``cuda.h`` and
  no matching cuda-bindings. Its fast path runs when the stream (or device) is live, the
  context healthy and already current in this thread: the checks of
  ``CudaStream._enter``, with the stream's (and event's) device, epoch and liveness read as one
  identity, ``_live is device.epoch_token``. The device's side of them (epoch, token, poisoned flag, pool, live
  sets) is cached and re-read only when the device's ``version`` cell moved (a seqlock, see
  ``Stamped``; the core reads it through a pointer), and so is the verdict on the last stream
  that passed (a stream's ``_live`` changes only through the same protocol), so a call reads
  one C integer, the thread's context token (kept for the last thread that called, and trusted
  while the count of token writes, ``TOKEN_WRITES``, is unchanged: two more C integers) and
  compares the stream with the last one (whose handle is kept too). Anything else (a closed stream, a
  rebuilt context, a first call in a thread, a foreign event) goes to the Python driver, which
  raises the precise error or makes the context current. A failed CUDA call is mapped by the
  device's own ``fail``, exactly as the Python driver maps it.

**The GIL is kept across each CUDA call.** These entry points return in about a microsecond; a
call that released the GIL would pay a GIL hand-off on return, which with several threads costs
tens of microseconds (measured, ``docs/performance.md``). Keeping it also makes the stream's
liveness check and its call one step no Python thread can come between: the job the stream's
gate does for the Python driver, so the fast path does not take the gate. A rebuild retires a
stream (under its gate, in Python, holding the GIL) either before the check, which then fails,
or after the call, whose work the rebuild's synchronize then waits for.

Why one module, longer than 400 lines: every fast path here (allocation, free, event record and
wait, query, graph launch and rebinding, the context check, a library actor's fill, pinned
copies and kernel launch) rests on the same cached view of the
device and the same stream verdict, and each must be read beside the checks it trusts.

Thread rule: any thread; an ops object's only mutable state is its cached view of the device,
read and written with the GIL held.
"""

from cpython.array cimport array
from cpython.dict cimport PyDict_GetItemWithError
from cpython.long cimport PyLong_AsVoidPtr, PyLong_FromUnsignedLongLong
from cpython.object cimport PyObject
from cpython.pystate cimport PyThreadState, PyThreadState_Get

import threading


cdef extern from "Python.h":
    # Unique per thread state for the interpreter's life (never reused), so a cached id cannot
    # match a thread state that died and was replaced.
    unsigned long long PyThreadState_GetID(PyThreadState* tstate)


cdef object _PlainLocal = threading.local

__all__ = ["CudaOps", "DriverOps", "ops_for"]


cdef class DriverOps:
    """The driver protocol's calls, through its Python methods (the host driver's path, and the
    slow path of :class:`CudaOps`).

    Thread rule: any thread.
    """

    def __init__(self, driver, ordinal):
        """Args:
            driver: the driver that owns the device.
            ordinal: the device's ordinal.
        Thread rule: any thread.
        """
        self.driver = driver
        self.ordinal = ordinal

    cdef object alloc_async(self, object nbytes, object stream):
        return self.driver.alloc_async(nbytes, stream)

    cdef free_async(self, object ptr, object stream):
        self.driver.free_async(ptr, stream)

    cdef record(self, object event, object stream):
        stream.record(event)

    cdef wait(self, object stream, object event):
        stream.wait(event)

    cdef object alloc(self, object nbytes):
        return self.driver.alloc(self.ordinal, nbytes)

    cdef free(self, object ptr):
        self.driver.free(self.ordinal, ptr)

    cdef object create_event(self):
        return self.driver.create_event(self.ordinal)

    def check_context(self):
        """``driver.check_context(ordinal)``: ``ContextLost`` when the device's primary context
        was reset from outside (see ``CudaDriver.check_context``), nothing otherwise.

        Raises:
            ContextLost: the primary context was reset from outside.
            DriverError: the driver is closed.
        Thread rule: any thread.
        """
        self.driver.check_context(self.ordinal)

    cdef graph_launch(self, object graph, object stream):
        graph.launch(stream)

    cdef bint query(self, object event) except -1:
        return event.query()

    cdef bint graph_host_set(self, object graph, object node, unsigned long long address) except -1:
        return False  # no fast path: the caller takes the graph's own ``swap_host``

    cdef memset_d8(self, object ptr, int byte, object nbytes, object stream):
        self.driver.fill(ptr, byte, nbytes, stream)

    # The two pinned copies: ``buf`` is a ``PinnedBuffer`` (page-locked, so the copy only
    # enqueues) and ``address`` its memory's. True when the copy went to ``libcuda`` directly: the
    # caller must then keep the buffer's memory referenced until the copy ran. False when the
    # driver's method ran it, which keeps what it copies from or into itself.
    cdef bint copy_htod(self, object ptr, object buf, unsigned long long address, object nbytes,
                        object stream) except -1:
        self.driver.copy_to_device(ptr, buf.view()[:nbytes], stream)
        return False

    cdef bint copy_dtoh(self, object buf, unsigned long long address, object ptr, object nbytes,
                        object stream) except -1:
        self.driver.copy_to_host_into(ptr, buf.view()[:nbytes], stream)
        return False

    # A kernel launch straight through ``cuLaunchKernel``: ``dims`` (grid x, y, z, block x, y, z)
    # and ``params`` (the ``void*[]`` of the packed values), both checked and packed by the
    # caller. True when launched; False when there is no such path (here, or a kernel not loaded
    # in the current epoch): nothing was done, and the caller takes the driver's ``launch``.
    cdef bint launch(self, object kernel, const unsigned int* dims, void** params, object stream) except -1:
        return False


cdef class CudaOps(DriverOps):
    """The CUDA driver's calls through ``libcuda`` entry points, with the Python driver as the
    slow path (see the module docstring).

    Thread rule: any thread.
    """

    def __init__(self, driver, ordinal, entry_points, device, tls, stream_type, event_type, cuda_result,
                 token_writes=None):
        """Args:
            driver: the ``CudaDriver``.
            ordinal: the device's ordinal.
            entry_points: name -> function address, from ``CudaDriver.entry_points()``.
            device: the driver's ``CudaDevice`` of ``ordinal``.
            tls: the driver's thread-local context marker.
            stream_type, event_type: ``CudaStream``, ``CudaEvent``.
            cuda_result: ``CUresult``, to hand failed codes to ``device.fail``.
            token_writes: the count of writes of every thread's ``tls.token``, a one-cell
                ``array('q')`` (``TOKEN_WRITES``), or None: then the token is read on every call.
        Raises:
            KeyError: an entry point is missing.
        Thread rule: any thread.
        """
        DriverOps.__init__(self, driver, ordinal)
        self._dev = device
        self._tls = tls
        self._tls_plain = type(tls) is _PlainLocal
        self._tls_dict = None
        self._tls_thread = 0  # no thread state has id 0
        self._tok_thread = 0
        self._tok_writes = -1
        self._tok_value = None
        cdef array writes
        if token_writes is None:
            self._token_writes = NULL
        else:
            writes = token_writes
            self._token_writes_keep = memoryview(writes)  # held: the cell cannot move
            self._token_writes = writes.data.as_longlongs
        self._last_stream = None
        self._last_handle = NULL
        self._stream_type = stream_type
        self._event_type = event_type
        self._cuda_result = cuda_result
        self._pool_obj = None
        cdef array cell = device.version
        # A view held: the cell's array cannot be resized (moved) while it is exported.
        self._version_keep = memoryview(cell)
        self._version = cell.data.as_longlongs
        self._seen = -1  # nothing cached yet (the cell is never negative)
        self._ok_stream = None
        self._ok_stream_seen = -1
        self._alloc_from_pool = <AllocFromPoolAsync_t>PyLong_AsVoidPtr(entry_points["cuMemAllocFromPoolAsync"])
        self._free_async = <FreeAsync_t>PyLong_AsVoidPtr(entry_points["cuMemFreeAsync"])
        self._event_record = <EventRecord_t>PyLong_AsVoidPtr(entry_points["cuEventRecord"])
        self._stream_wait_event = <StreamWaitEvent_t>PyLong_AsVoidPtr(entry_points["cuStreamWaitEvent"])
        self._mem_alloc = <MemAlloc_t>PyLong_AsVoidPtr(entry_points["cuMemAlloc"])
        self._mem_free = <MemFree_t>PyLong_AsVoidPtr(entry_points["cuMemFree"])
        self._graph_launch = <GraphLaunch_t>PyLong_AsVoidPtr(entry_points["cuGraphLaunch"])
        self._event_query = <EventQuery_t>PyLong_AsVoidPtr(entry_points["cuEventQuery"])
        self._graph_memcpy_set = <GraphMemcpySet_t>PyLong_AsVoidPtr(entry_points["cuGraphExecMemcpyNodeSetParams"])
        self._graph_kernel_set = <GraphKernelSet_t>PyLong_AsVoidPtr(entry_points["cuGraphExecKernelNodeSetParams"])
        self._primary_state = <PrimaryCtxGetState_t>PyLong_AsVoidPtr(entry_points["cuDevicePrimaryCtxGetState"])
        self._memset_d8 = <MemsetD8Async_t>PyLong_AsVoidPtr(entry_points["cuMemsetD8Async"])
        self._memcpy_htod = <MemcpyHtoDAsync_t>PyLong_AsVoidPtr(entry_points["cuMemcpyHtoDAsync"])
        self._memcpy_dtoh = <MemcpyDtoHAsync_t>PyLong_AsVoidPtr(entry_points["cuMemcpyDtoHAsync"])
        self._launch_kernel = <LaunchKernel_t>PyLong_AsVoidPtr(entry_points["cuLaunchKernel"])
        self._functions = {}
        self._functions_token = None
        self._cudev = int(device.cudev)

    cdef bint _current(self):
        """True when the device is healthy and its context current in this thread, refreshing the
        cached view of the device first if its version cell moved."""
        cdef long long seen = self._version[0]
        if seen != self._seen:
            if seen & 1:
                return False  # an assignment is under way: the Python driver decides
            dev = self._dev
            token = dev.token
            self._live_token = dev.epoch_token
            self._token = token
            self._live = token is not None and dev.poisoned is None
            pool = dev.pool
            if pool is not None and pool is not self._pool_obj:
                self._pool = PyLong_AsVoidPtr(int(pool))
            self._pool_obj = pool
            self._pool_live = dev.pool_live
            self._direct_live = dev.direct_live
            if self._version[0] != seen:
                # A finalizer run by the reads above assigned meanwhile: cache nothing.
                self._seen = -1
                return False
            self._seen = seen
        return self._live and self._thread_token() is self._token

    cdef object _thread_token(self):
        """``getattr(tls, "token", None)`` in the calling thread. A plain ``threading.local``'s
        attribute read costs a thread-state dict lookup, a type lookup and the attribute's dict
        lookup (about 430 instructions). Two caches make a repeated call cheap:

        * the token itself, for the last thread state that asked, while the count of token writes
          (``TOKEN_WRITES``, read through a pointer) is the one seen when it was read: a thread's
          token changes only through ``set_thread_token``, which counts every write, so an
          unchanged count means an unchanged token (two integer compares);
        * else the calling thread's own dict of ``tls``, for the last thread state that read it:
          one dict lookup. That dict is the one ``tls`` reads and writes in that thread for as long
          as the thread state lives (``threading.local``'s ``__dict__`` cannot be replaced).

        A thread state's id is never reused, so neither cache is ever another thread's."""
        cdef unsigned long long tid
        cdef long long writes = 0
        cdef PyObject* found
        if not self._tls_plain:
            return getattr(self._tls, "token", None)
        tid = PyThreadState_GetID(PyThreadState_Get())
        if self._token_writes != NULL:
            writes = self._token_writes[0]
            if tid == self._tok_thread and writes == self._tok_writes:
                return self._tok_value
        if tid != self._tls_thread:
            # Keep the old dict referenced until both fields are set: dropping it could run a
            # finalizer, and another thread must never see this thread's id beside its dict.
            old = self._tls_dict
            self._tls_dict = self._tls.__dict__
            self._tls_thread = tid
            del old
        found = PyDict_GetItemWithError(self._tls_dict, "token")  # a str key: it cannot fail
        value = <object>found if found != NULL else None
        if self._token_writes != NULL:
            # All three set before the old token is let go (as above).
            old_value = self._tok_value
            self._tok_value = value
            self._tok_thread = tid
            self._tok_writes = writes
            del old_value
        return value

    cdef bint _stream_ok(self, object s):
        """``s`` is a live stream of this device's current epoch (call right after ``_current``
        said True, so ``_seen`` is the cell's value): its ``_live`` is the device's
        ``epoch_token`` exactly while that holds (see ``CudaStream``). The last stream that
        passed is remembered with the cell's value: a stream's ``_live`` ends only through
        ``assign_stamped``, which moves the cell."""
        if s is self._ok_stream and self._ok_stream_seen == self._seen:
            return True
        if type(s) is not self._stream_type or s._live is not self._live_token:
            return False
        # Both fields set before the old stream is let go: dropping it could run Python code.
        old = self._ok_stream
        self._ok_stream = s
        self._ok_stream_seen = self._seen
        del old
        return True

    cdef CUstream _handle_of(self, object s) except? NULL:
        """The CUDA handle of stream ``s``. A stream's ``_handle`` never changes, so the last
        stream's is kept here (the stream itself held, so its identity cannot be reused) and a
        run of calls on one stream reads no attribute for it."""
        if s is not self._last_stream:
            # Both fields set before the old stream is let go: dropping it could run Python code.
            old = self._last_stream
            self._last_handle = PyLong_AsVoidPtr(s._handle)
            self._last_stream = s
            del old
        return self._last_handle

    cdef object alloc_async(self, object nbytes, object stream):
        cdef CUdeviceptr ptr = 0
        cdef CUresult err
        if (not self._current() or self._pool_obj is None or not self._stream_ok(stream)
                or type(nbytes) is not int or nbytes <= 0):
            return DriverOps.alloc_async(self, nbytes, stream)
        err = self._alloc_from_pool(&ptr, <size_t>nbytes, self._pool, self._handle_of(stream))
        if err != 0:
            self._dev.fail(self._cuda_result(err),
                           f"cuMemAllocFromPoolAsync({nbytes} bytes, stream {stream._id})", nbytes)
        result = PyLong_FromUnsignedLongLong(ptr)
        self._pool_live.add(result)
        return result

    cdef free_async(self, object ptr, object stream):
        cdef CUresult err
        if not self._current() or not self._stream_ok(stream) or type(ptr) is not int or ptr <= 0:
            DriverOps.free_async(self, ptr, stream)
            return
        err = self._free_async(<CUdeviceptr>ptr, self._handle_of(stream))
        if err != 0:
            self._dev.fail(self._cuda_result(err), f"cuMemFreeAsync({ptr:#x}, stream {stream._id})")
        self._pool_live.discard(ptr)

    cdef record(self, object event, object stream):
        cdef CUresult err
        if (not self._current() or not self._stream_ok(stream) or type(event) is not self._event_type
                or event._live is not self._live_token):
            DriverOps.record(self, event, stream)
            return
        err = self._event_record(PyLong_AsVoidPtr(event._h), self._handle_of(stream))
        if err != 0:
            self._dev.fail(self._cuda_result(err), f"cuEventRecord(stream {stream._id})")

    cdef wait(self, object stream, object event):
        cdef CUresult err
        if (not self._current() or not self._stream_ok(stream) or type(event) is not self._event_type
                or event._live is not self._live_token):
            DriverOps.wait(self, stream, event)
            return
        err = self._stream_wait_event(self._handle_of(stream), PyLong_AsVoidPtr(event._h), 0)
        if err != 0:
            self._dev.fail(self._cuda_result(err), f"cuStreamWaitEvent(stream {stream._id})")

    cdef graph_launch(self, object graph, object stream):
        # A ``CudaGraph`` (driver/cuda/graph.py) of this device, open, of the current epoch (its
        # ``_live`` is the epoch token it was made under) and with no replaced host views waiting
        # to be handed to a stream (``_retired``): then its launch is the one call. Anything else
        # goes to ``CudaGraph.launch``, which raises the precise error or keeps the views. The
        # caller serializes launches with the graph's updates and close (``BatchGraph``'s lock);
        # the GIL, kept from the checks to the call, keeps a rebuild from coming between.
        cdef CUresult err
        if (not self._current() or not self._stream_ok(stream) or getattr(graph, "_live", None) is not self._live_token
                or graph._closed or graph._retired or graph._dev is not self._dev):
            DriverOps.graph_launch(self, graph, stream)
            return
        err = self._graph_launch(PyLong_AsVoidPtr(graph._exec_h), self._handle_of(stream))
        if err != 0:
            self._dev.fail(self._cuda_result(err), f"cuGraphLaunch(stream {stream._id})")
        graph._last_stream = stream

    cdef bint query(self, object event) except -1:
        cdef CUresult err
        if not self._current() or type(event) is not self._event_type or event._live is not self._live_token:
            return DriverOps.query(self, event)
        err = self._event_query(PyLong_AsVoidPtr(event._h))
        if err == 0:
            return True
        if err == 600:  # CUDA_ERROR_NOT_READY
            return False
        self._dev.fail(self._cuda_result(err), "cuEventQuery")
        return False

    def check_context(self):
        # The state read of ``CudaDevice.primary_active`` in one C call; the Python driver's
        # check only when the context is seen inactive (it raises the precise error and clears
        # the thread's context mark) or the device is not retained or is poisoned (where the
        # check returns at once).
        cdef unsigned int flags = 0
        cdef int active = 0
        dev = self._dev
        if self.driver._closed:
            DriverOps.check_context(self)  # raises the driver's DriverError
            return
        if dev.token is None or dev.poisoned is not None:
            return
        if self._primary_state(self._cudev, &flags, &active) != 0 or active:
            return
        DriverOps.check_context(self)

    cdef bint graph_host_set(self, object graph, object node, unsigned long long address) except -1:
        # A host copy node of an open ``CudaGraph`` of this device and of the current epoch, with
        # its host pointer field located (``node.host_at``): the new address is written into the
        # node's kept ``CUDA_MEMCPY3D`` (or, for a copy-kernel node, its argument slot) and set on
        # the exec. False (nothing done) otherwise: the
        # caller takes ``CudaGraph.swap_host``, which raises the precise error. The caller
        # serializes this with the graph's other calls, as for ``graph_launch``.
        cdef CUresult err
        cdef unsigned long long* cell
        cdef unsigned long long old
        if (not self._current() or getattr(graph, "_live", None) is not self._live_token or graph._closed
                or graph._dev is not self._dev or not node.host_at):
            return False
        cell = <unsigned long long*>PyLong_AsVoidPtr(node.host_at)
        old = cell[0]
        cell[0] = address
        if node.args is not None:
            err = self._graph_kernel_set(PyLong_AsVoidPtr(graph._exec_h), PyLong_AsVoidPtr(node.node_h),
                                         PyLong_AsVoidPtr(node.params_h))
        else:
            err = self._graph_memcpy_set(PyLong_AsVoidPtr(graph._exec_h), PyLong_AsVoidPtr(node.node_h),
                                         PyLong_AsVoidPtr(node.params_h), PyLong_AsVoidPtr(graph._ctx_h))
        if err != 0:
            cell[0] = old
            self._dev.fail(self._cuda_result(err), "cuGraphExecKernelNodeSetParams" if node.args is not None
                           else "cuGraphExecMemcpyNodeSetParams")
        return True

    # The enqueue-only calls of a library actor's one-handle work (``library_core``): a live
    # stream of the current epoch, the context current, a positive size (the caller's block and
    # buffer bound it); anything else goes to the driver's method, which raises the precise error.
    cdef bint _enqueue_ok(self, object ptr, object nbytes, object stream):
        return (self._current() and self._stream_ok(stream) and type(ptr) is int and ptr > 0
                and type(nbytes) is int and nbytes > 0)

    cdef memset_d8(self, object ptr, int byte, object nbytes, object stream):
        cdef CUresult err
        if not self._enqueue_ok(ptr, nbytes, stream):
            DriverOps.memset_d8(self, ptr, byte, nbytes, stream)
            return
        err = self._memset_d8(<CUdeviceptr>ptr, <unsigned char>byte, <size_t>nbytes, self._handle_of(stream))
        if err != 0:
            self._dev.fail(self._cuda_result(err), f"cuMemsetD8Async({nbytes} bytes at {ptr:#x}, stream {stream._id})")

    cdef bint copy_htod(self, object ptr, object buf, unsigned long long address, object nbytes,
                        object stream) except -1:
        cdef CUresult err
        if address == 0 or not self._enqueue_ok(ptr, nbytes, stream):
            return DriverOps.copy_htod(self, ptr, buf, address, nbytes, stream)
        err = self._memcpy_htod(<CUdeviceptr>ptr, <const void*>address, <size_t>nbytes, self._handle_of(stream))
        if err != 0:
            self._dev.fail(self._cuda_result(err), f"cuMemcpyHtoDAsync({nbytes} bytes to {ptr:#x}, stream {stream._id})")
        return True

    cdef bint copy_dtoh(self, object buf, unsigned long long address, object ptr, object nbytes,
                        object stream) except -1:
        cdef CUresult err
        if address == 0 or not self._enqueue_ok(ptr, nbytes, stream):
            return DriverOps.copy_dtoh(self, buf, address, ptr, nbytes, stream)
        err = self._memcpy_dtoh(<void*>address, <CUdeviceptr>ptr, <size_t>nbytes, self._handle_of(stream))
        if err != 0:
            self._dev.fail(self._cuda_result(err), f"cuMemcpyDtoHAsync({nbytes} bytes from {ptr:#x}, stream {stream._id})")
        return True

    cdef bint launch(self, object kernel, const unsigned int* dims, void** params, object stream) except -1:
        # The kernel must be loaded in the current epoch already (the device's ``functions``, which
        # a rebuild empties; its handles are kept here by epoch): a first launch, which compiles and
        # loads it, goes to the driver's method.
        cdef CUresult err
        if not self._current() or not self._stream_ok(stream):
            return False
        if self._functions_token is not self._live_token:
            self._functions = {}
            self._functions_token = self._live_token
        found = self._functions.get(kernel)
        if found is None:
            loaded = self._dev.functions.get(kernel)
            if loaded is None:
                return False
            found = self._functions[kernel] = int(loaded)
        err = self._launch_kernel(PyLong_AsVoidPtr(found), dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], 0,
                                  self._handle_of(stream), params, NULL)
        if err != 0:
            self._dev.fail(self._cuda_result(err), f"cuLaunchKernel({kernel.name}, stream {stream._id})")
        return True

    cdef object alloc(self, object nbytes):
        cdef CUdeviceptr ptr = 0
        cdef CUresult err
        if type(nbytes) is not int or nbytes <= 0 or not self._current() or self.driver._closed:
            return DriverOps.alloc(self, nbytes)
        err = self._mem_alloc(&ptr, <size_t>nbytes)
        if err != 0:
            self._dev.fail(self._cuda_result(err), f"cuMemAlloc({nbytes} bytes)", nbytes)
        result = PyLong_FromUnsignedLongLong(ptr)
        self._direct_live.add(result)
        return result

    cdef free(self, object ptr):
        cdef CUresult err
        if (type(ptr) is not int or ptr <= 0 or not self._current() or self.driver._closed
                or ptr not in self._direct_live):
            DriverOps.free(self, ptr)  # the precise error for a pointer that is not live, too
            return
        # Claimed first, as the Python driver does: of a free racing a rebuild's sweep, exactly
        # one reaches cuMemFree. (No Python code runs between the check above and this.)
        self._direct_live.remove(ptr)
        err = self._mem_free(<CUdeviceptr>ptr)
        if err != 0:
            self._dev.fail(self._cuda_result(err), f"cuMemFree({ptr:#x})")


cpdef DriverOps ops_for(object driver, object ordinal):
    """The ops of device ``ordinal`` of ``driver``: :class:`CudaOps` where the driver offers
    entry points (its class's ``fast_path(ordinal)`` returns what ``CudaOps`` needs), else
    :class:`DriverOps`.

    Args:
        driver: any driver of the protocol.
        ordinal: the device's ordinal.
    Returns:
        The ops object.
    Thread rule: any thread.
    """
    # Looked up on the type: a proxy that forwards attributes to a CUDA driver must still see
    # its own methods called.
    fast_path = getattr(type(driver), "fast_path", None)
    if fast_path is not None:
        spec = fast_path(driver, ordinal)
        if spec is not None:
            return CudaOps(driver, ordinal, *spec)
    return DriverOps(driver, ordinal)
