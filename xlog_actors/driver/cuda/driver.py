"""``CudaDriver``: the driver protocol on ``cuda.bindings.driver`` (cuda-python), composed of the
package's parts.

What it is made of, and why (each part's module says more):

* :mod:`.call`: the raw driver call and every ``CUresult`` mapped to a typed error.
* :mod:`.context`: one :class:`~.context.CudaDevice` per ordinal: its primary-context retain,
  memory pool, loaded modules, and the rebuild and close of what this driver made in it.
* :mod:`.streams`: ``CudaStream`` and ``CudaEvent``, each stream's gate and its retirement.
* :mod:`.memory`: allocation (synchronous and pool), copies, fills.
* :mod:`.peer`: copies between two devices (``cuMemcpyPeerAsync``).
* :mod:`.nvrtc`: kernel sources compiled into cubins, and the sleep kernel.
* :mod:`.gates`: the device table and the one preamble of stream work.
* :mod:`.held`: the enqueue-only calls (pinned host copies, device copies, launches, event
  create/record/query, stream waits, the context check) made through prototypes that keep the
  GIL; every other call goes through cuda.bindings, which lets it go.

**Kernels.** ``launch`` compiles ``kernel.source`` (:func:`~.nvrtc.compile_cubin`), loads it into
the context once per (context, kernel) with ``cuModuleLoadData``; arguments are packed by
``kernel.params`` into 8-byte slots (``struct`` into ctypes memory, no numpy) and launched
with ``cuLaunchKernel``. cuda.core's ``Program``/``launch`` are not used: ``Kernel.options`` are
raw NVRTC flags, which ``ProgramOptions`` cannot take, and cuda.core's context-independent
``CUlibrary`` kernels and stream wrappers do not fit a driver that must drop and rebuild every
per-context module in ``rebuild_context``; here each of the two steps is a single call.

This module is over 400 lines only through its docstrings: each method states its CUDA call, its
errors and its thread rule; the code itself is a thin layer over the package's parts.

Thread rules: every method may be called from any thread. Each device has one re-entrant lock that
guards its context's lifecycle (retain, rebuild, close), its stream registry and its loaded
modules; the hot paths (allocation, copies, launches, event operations) take no device lock, only
the stream's own gate: they read the device's context token and a stream's epoch, and a stream or
event of an older epoch raises ``DriverError`` (``CUDA_ERROR_INVALID_HANDLE``) instead of reaching
CUDA with a dead handle. Each stream's gate (a lock held across its liveness check and the CUDA
call) makes work on a stream and a rebuild exclusive: the rebuild retires every stream through its
gate before it synchronizes and frees, so stream work racing it either ran before (and was waited
for) or is refused; none runs on freed memory. A synchronous ``free`` claims its pointer from the
live set first, so it and a rebuild's sweep never both free it; a synchronous ``alloc`` racing a
rebuild is the caller's race to avoid (it may leak that block).
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ...errors import ContextLost, DeviceUnavailable, InvalidRequest, XlogError
from ..checks import check_launch, check_microseconds
from ..graph import (
    DeviceToDevice,
    DeviceToHost,
    GraphStep,
    HostToDevice,
    KernelStep,
    Memset,
    check_lanes,
    check_steps,
)
from ..kernel import Kernel
from ..protocol import Driver
from .call import (
    CORE_ENTRY_POINTS,
    EVENT_FLAGS,
    IMPORT_ERROR,
    STREAM_FLAGS,
    SUCCESS,
    cu,
    error_for,
    first_line,
    resolve_entry_points,
    result_name,
)
from .context import CudaDevice
from .current import TOKEN_WRITES, set_thread_token, tls
from .gates import check_ptr
from .graph import CudaGraph
from .graph_copies import COPY_KERNEL, KERNEL_COPY_MAX
from .held import HELD_ENTRY_POINTS, HeldCalls, as_result
from .memory import CudaMemory
from .nvrtc import SLEEP_KERNEL
from .peer import CudaPeer
from .streams import CudaEvent, CudaStream

__all__ = ["CudaDriver"]


#: Each parameter kind in its own 8-byte slot (``struct`` codes, padded), as cuLaunchKernel reads it.
_SLOT_CODES = {"ptr": "Q", "u64": "Q", "i64": "q", "u32": "I4x", "i32": "i4x", "f32": "f4x", "f64": "d"}


class _Packer:
    """How the arguments of one parameter list are packed: ``n`` value slots, then the ``n``
    pointers to them (the ``void*[]`` cuLaunchKernel reads), in one ctypes array of 2n words.
    Each thread packs into an array of its own, made once (its pointers written then), so a
    launch only packs the values: cuLaunchKernel copies them before it returns, and a thread
    launches one kernel at a time. Made once per parameter list; immutable but for the
    per-thread arrays."""

    __slots__ = ("array_type", "n", "tls", "values")

    def __init__(self, kernel: Kernel) -> None:
        codes = []
        for kind in kernel.params:
            code = _SLOT_CODES.get(kind)
            if code is None:
                raise InvalidRequest(f"kernel {kernel.name}: unknown parameter kind {kind!r}")
            codes.append(code)
        self.n = len(codes)
        self.values = struct.Struct("<" + "".join(codes))
        self.array_type: type[ctypes.Array[ctypes.c_uint64]] = ctypes.c_uint64 * max(1, 2 * self.n)
        self.tls = threading.local()

    def slots(self) -> tuple[ctypes.Array[ctypes.c_uint64], int]:
        """The calling thread's array and the address of its pointers (0 without parameters)."""
        try:
            return self.tls.slots  # type: ignore[no-any-return]
        except AttributeError:
            slots = self.array_type()
            base, n = ctypes.addressof(slots), self.n
            struct.pack_into(f"<{n}Q", slots, 8 * n, *range(base, base + 8 * n, 8))
            self.tls.slots = (slots, base + 8 * n if n else 0)
            return self.tls.slots  # type: ignore[no-any-return]


_packers: dict[tuple[str, ...], _Packer] = {}
_BOOLS = frozenset((bool, np.bool_))


def _pack_args(kernel: Kernel, args: Sequence[object]) -> tuple[ctypes.Array[ctypes.c_uint64], int]:
    """``(slots, params)``: each argument in its own 8-byte slot of ``slots`` (every parameter
    kind fits, suitably aligned), followed by the pointers to them; ``params`` is the address of
    those pointers, what cuLaunchKernel reads (0 for a kernel without parameters). ``slots`` is
    the calling thread's own, valid until its next call (cuLaunchKernel copies the values).

    No numpy on the common path (a launch per batch pays it): ``struct`` packs straight into the
    ctypes array. ``check_launch`` has judged the arguments already; what ``struct`` still refuses
    (a bool, a value out of its slot's range, a float for an integer) is ``InvalidRequest`` here
    too. A real number out of ``f32`` range packs as an infinity, as numpy (the host twin) rounds it."""
    packer = _packers.get(kernel.params)
    if packer is None:
        packer = _packers[kernel.params] = _Packer(kernel)
    if len(args) != packer.n:
        raise InvalidRequest(f"kernel {kernel.name}: takes {packer.n} arguments, got {len(args)}")
    if not _BOOLS.isdisjoint(map(type, args)):
        raise InvalidRequest(f"kernel {kernel.name}: arguments {list(args)!r}: a bool is no kernel argument")
    slots, params = packer.slots()
    try:
        try:
            packer.values.pack_into(slots, 0, *args)
        except OverflowError:  # an f32 past its range: the infinity it rounds to
            with np.errstate(over="ignore"):
                saturated = [float(np.float32(v)) if k == "f32" else v  # type: ignore[arg-type]
                             for k, v in zip(kernel.params, args, strict=True)]
            packer.values.pack_into(slots, 0, *saturated)
    except (struct.error, OverflowError, TypeError, ValueError) as exc:
        raise InvalidRequest(
            f"kernel {kernel.name}: arguments {list(args)!r} do not fit {kernel.params}: {exc}"
        ) from None
    return slots, params


class CudaDriver(CudaPeer, CudaMemory):
    """The driver protocol on cuda-python. See the module docstring.

    Construction runs ``cuInit`` and counts devices; it raises ``DeviceUnavailable`` (with the
    reason, never a cuda-python traceback) when cuda-python or libcuda cannot be loaded,
    ``cuInit`` fails, or no device is visible. Contexts are retained on each ordinal's first use.

    Every method taking an ordinal raises ``InvalidRequest`` when it is out of range,
    ``DriverError`` when the driver is closed or CUDA refuses the call (``ContextLost``, a
    ``DriverError``, when the context was reset from outside), and ``ContextPoisoned`` once the
    device saw a sticky error; ``OutOfMemory`` where the device runs out of memory.

    ``ipc_pool`` (read-only after construction): whether the devices' ``async`` stacks allocate
    from IPC-capable pools (see ``__init__``).

    Thread rule: any thread (see the module docstring).
    """

    kind: Literal["cuda"] = "cuda"

    def __init__(self, *, ipc_pool: bool = False) -> None:
        """Run ``cuInit``, count the devices and query each one's architecture.

        Args:
            ipc_pool: each device's ``async`` stack allocates from an IPC-capable pool of its own
                (``cuMemPoolCreate`` with POSIX file descriptor handles) instead of the device's
                default pool, so that its blocks can be pickled to other processes (see
                :mod:`.pool_ipc`); a device whose pools cannot be shared then fails its first
                use with ``DriverError`` (``CUDA_ERROR_NOT_SUPPORTED``).

        Raises:
            InvalidRequest: ``ipc_pool`` is not a bool.
            DeviceUnavailable: cuda-python or libcuda cannot be loaded, ``cuInit`` fails, no device is
                visible, or a device cannot be queried; the message says which, with no cuda-python
                exception chained.
        Thread rule: any thread.
        """
        if type(ipc_pool) is not bool:
            raise InvalidRequest(f"ipc_pool is a bool, not {ipc_pool!r}")
        if cu is None:
            raise DeviceUnavailable(
                f"cuda-python is not importable ({IMPORT_ERROR}); install cuda-python>=13"
            )
        try:
            (err,) = cu.cuInit(0)
        except Exception as exc:  # noqa: BLE001 - cuda.pathfinder's DynamicLibNotFoundError & co.
            raise DeviceUnavailable(
                "the NVIDIA driver library libcuda could not be loaded, so no CUDA GPU is "
                f"reachable: {first_line(exc)}"
            ) from None
        if err != SUCCESS:
            raise DeviceUnavailable(f"cuInit failed: {result_name(err)}; no CUDA GPU is usable") from None
        err, count = cu.cuDeviceGetCount()
        if err != SUCCESS:
            raise DeviceUnavailable(f"cuDeviceGetCount failed: {result_name(err)}") from None
        if count < 1:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            raise DeviceUnavailable(f"libcuda is loaded but sees no CUDA device{hint}")
        try:
            entry_points = resolve_entry_points(CORE_ENTRY_POINTS + HELD_ENTRY_POINTS)
        except XlogError as exc:
            raise DeviceUnavailable(f"{exc}; update the NVIDIA driver") from None
        self._entry_points = entry_points
        held = HeldCalls(entry_points)
        devices = []
        for ordinal in range(count):
            err, cudev = cu.cuDeviceGet(ordinal)
            if err != SUCCESS:
                raise DeviceUnavailable(f"cuDeviceGet({ordinal}) failed: {result_name(err)}") from None
            try:
                devices.append(CudaDevice(ordinal, cudev, held))
            except XlogError as exc:
                raise DeviceUnavailable(f"device {ordinal} cannot be queried: {exc}") from None
        for dev in devices:
            dev.owner = self
            dev.ipc_pool = ipc_pool
        self.ipc_pool = ipc_pool
        self._devices = devices
        self._closed = False
        self._close_lock = threading.Lock()

    def __repr__(self) -> str:
        ipc = ", ipc_pool=True" if self.ipc_pool else ""
        return f"CudaDriver(device_count={len(self._devices)}{ipc}{', closed' if self._closed else ''})"

    # -- queries ----------------------------------------------------------------------------
    def fast_path(self, ordinal: object) -> tuple[Any, ...] | None:
        """What the compiled core's ``CudaOps`` needs to call ``libcuda`` directly for device
        ``ordinal``: the entry points, the device, the thread-local context marker, the stream
        and event types and ``CUresult``.

        ``CudaOps`` reads these attributes of the objects it is given, with the GIL held: of a
        ``CudaStream`` ``_dev``, ``_epoch``, ``_closed``, ``_handle`` and ``_id``; of a
        ``CudaEvent`` ``_dev``, ``_epoch`` and ``_h``; of a ``CudaDevice`` ``token``, ``epoch``,
        ``poisoned``, ``pool``, ``pool_live``, ``direct_live`` and ``fail``; of the driver
        ``_closed``. Their meaning is the one ``CudaStream._enter`` checks.

        Args:
            ordinal: a device ordinal.
        Returns:
            The tuple, or None when ``ordinal`` names no device of this driver (the Python
            methods then raise the precise error).
        Thread rule: any thread.
        """
        if type(ordinal) is not int or not 0 <= ordinal < len(self._devices):
            return None
        return (self._entry_points, self._devices[ordinal], tls, CudaStream, CudaEvent, cu.CUresult, TOKEN_WRITES)

    def device_count(self) -> int:
        """The number of CUDA devices visible at construction. Thread rule: any thread."""
        return len(self._devices)

    def device_name(self, ordinal: int) -> str:
        """Device ``ordinal``'s product name (``cuDeviceGetName``).

        Arguments and result: as ``Driver.device_name``.
        Raises:
            InvalidRequest, DriverError, ContextPoisoned: see the class docstring.
        Thread rule: any thread; needs no context (the device handle suffices).
        """
        dev = self._device(ordinal)
        err, name = cu.cuDeviceGetName(256, dev.cudev)
        if err != SUCCESS:
            dev.fail(err, "cuDeviceGetName")
        return bytes(name).split(b"\0", 1)[0].decode(errors="replace").strip()

    def compute_capability(self, ordinal: int) -> str:
        """The device's architecture as NVRTC names it (``"sm_90"``).

        Args:
            ordinal: the device.
        Returns:
            ``"sm_<major><minor>"``.
        Raises:
            InvalidRequest: ``ordinal`` is out of range.
            DriverError: the driver is closed.
        Thread rule: any thread.
        """
        return self._device(ordinal).arch

    def mem_info(self, ordinal: int) -> tuple[int, int]:
        """``(free, total)`` bytes of device ``ordinal`` (``cuMemGetInfo``).

        Arguments and result: as ``Driver.mem_info``.
        Raises:
            InvalidRequest, DriverError, ContextPoisoned: see the class docstring.
        Thread rule: any thread; makes the device's context current in the calling thread.
        """
        dev = self._device(ordinal)
        dev.enter()
        err, free, total = cu.cuMemGetInfo()
        if err != SUCCESS:
            dev.fail(err, "cuMemGetInfo")
        return int(free), int(total)

    def make_current(self, ordinal: int) -> None:
        """Make ``ordinal``'s context current in this thread, unconditionally (refreshes the
        thread-local cache, e.g. after foreign code switched contexts).

        Arguments and result: as ``Driver.make_current``.
        Raises:
            InvalidRequest, DriverError, ContextPoisoned: see the class docstring.
        Thread rule: any thread; acts on the calling thread.
        """
        dev = self._device(ordinal)
        dev.enter()
        dev.set_current()

    # -- streams and events -----------------------------------------------------------------
    def create_stream(self, ordinal: int) -> CudaStream:
        """A new ``CU_STREAM_NON_BLOCKING`` stream on device ``ordinal``.

        Arguments and result: as ``Driver.create_stream``.
        Raises:
            InvalidRequest, DriverError, ContextPoisoned: see the class docstring.
        Thread rule: any thread; takes the device lock.
        """
        dev = self._device(ordinal)
        with dev.lock:  # the epoch read and the creation must not straddle a rebuild
            dev.enter()
            if dev.graveyard:
                dev.bury()
            err, handle = cu.cuStreamCreate(STREAM_FLAGS)
            if err != SUCCESS:
                dev.fail(err, "cuStreamCreate")
            stream = CudaStream(dev, handle, dev.epoch)
            dev.streams.add(stream)
        return stream

    def create_event(self, ordinal: int) -> CudaEvent:
        """A new ``CU_EVENT_DISABLE_TIMING`` event on device ``ordinal``, never recorded.

        Arguments and result: as ``Driver.create_event``.
        Raises:
            InvalidRequest, DriverError, ContextPoisoned: see the class docstring.
        Thread rule: any thread; destroys collected handles first (takes the device lock then).
        """
        dev = self._device(ordinal)
        dev.enter()
        if dev.graveyard:
            dev.bury()
        # The token before the epoch: a rebuild in between leaves an old token with the new epoch,
        # which only sends the event down the slow path (a teardown moves the epoch first).
        live = dev.epoch_token
        epoch = dev.epoch
        err, event = cu.cuEventCreate(EVENT_FLAGS)
        if err != SUCCESS:
            dev.fail(err, "cuEventCreate")
        return CudaEvent(dev, event, epoch, live)

    def sleep(self, stream: CudaStream, microseconds: int) -> None:
        """Enqueue the sleep kernel (:data:`~.nvrtc.SLEEP_KERNEL`): about ``microseconds`` of
        wall-clock time on ``stream``.

        Arguments and result: as ``Driver.sleep``.
        Raises:
            InvalidRequest: bad ``microseconds`` or ``stream``.
            DriverError: NVRTC is missing (naming ``libnvrtc``); the stream was closed or its context
                rebuilt.
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread.
        """
        us = check_microseconds(microseconds)
        self.launch(SLEEP_KERNEL, 1, 1, (int(us * 1000),), stream)

    def launch(
        self, kernel: Kernel, grid: Sequence[int] | int, block: Sequence[int] | int, args: Sequence[object],
        stream: CudaStream,
    ) -> None:
        """Enqueue ``kernel`` with ``cuLaunchKernel``: compiled (once per process and architecture)
        and loaded (once per context) first.

        Arguments and result: as ``Driver.launch``.
        Raises:
            InvalidRequest: malformed dimensions, arguments that do not match ``kernel.params``, or a
                stream of another driver.
            DriverError: ``CUDA_ERROR_INVALID_VALUE`` for a dimension outside the device's limits
                (refused before ``cuLaunchKernel``, as it would refuse it).
            DriverError: the kernel does not compile or load; the stream was closed or its context
                rebuilt.
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread; loads outside the stream's gate (loading takes the device lock).
        """
        g, b = check_launch(kernel, grid, block, args)  # the very checks the host driver makes
        _, params = _pack_args(kernel, args)  # the thread's own slots, kept until its next launch
        s = self._stream_work(stream)
        fn = s._enter().function(kernel)  # outside the gate: loading may take the device lock
        with s._gate:
            dev = s._enter()  # a rebuild since the lookup retired the stream (and the module)
            # It only enqueues: the GIL is kept (see .held).
            err = as_result(dev.held.launch(int(fn), g[0], g[1], g[2], b[0], b[1], b[2], 0, s._handle, params, None))
        if err != SUCCESS:
            dev.fail(err, f"cuLaunchKernel({kernel.name}, grid={g}, block={b}, stream {s._id})")

    def record_graph(self, ordinal: int, steps: Sequence[GraphStep], lanes: Sequence[int] | None = None) -> CudaGraph:
        """Record ``steps`` as a ``CUgraphExec`` of explicit nodes, one per step, a chain per
        lane (:mod:`.graph`); kernels are compiled and loaded first, the copy kernel too when a
        host copy is small enough to be one (:mod:`.graph_copies`).

        Arguments and result: as ``Driver.record_graph``.
        Raises:
            InvalidRequest: a malformed step or lane list, a host view outside pinned memory,
                kernel arguments that do not match the kernel, a bad ordinal.
            DriverError: a kernel does not compile or load; the driver refuses a node.
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread; loading a kernel takes the device lock.
        """
        checked = check_steps(steps)
        lane_lengths = check_lanes(lanes, len(checked))
        dev = self._device(ordinal)
        dev.enter()
        functions = []
        copy_fn = None
        for step in checked:
            if isinstance(step, KernelStep):
                check_launch(step.kernel, step.grid, step.block, list(step.args))
                _pack_args(step.kernel, step.args)  # its refusals first, before any node is made
                functions.append(dev.function(step.kernel))
            elif isinstance(step, (DeviceToDevice, Memset)):
                check_ptr(step.dst, f"device {ordinal}: graph step")
                if isinstance(step, DeviceToDevice):
                    check_ptr(step.src, f"device {ordinal}: graph step")
            elif isinstance(step, (HostToDevice, DeviceToHost)) and copy_fn is None and dev.unified \
                    and step.nbytes <= KERNEL_COPY_MAX:
                copy_fn = dev.function(COPY_KERNEL)
        with dev.lock:
            dev.enter()
            return CudaGraph(dev, checked, functions, _pack_args, self._is_pinned, lane_lengths, copy_fn)

    # -- context lifetime -------------------------------------------------------------------
    def check_context(self, ordinal: int) -> None:
        """Raise ``ContextLost`` when ``ordinal``'s primary context was reset behind this driver's
        back (by another library's ``cuDevicePrimaryCtxReset``), before any of its now dangling
        handles reaches CUDA: CUDA does not report such a use, it may crash the process (seen on
        an H200: a segfault). One driver call on the *device* handle, which stays valid: after a
        reset the primary context is inactive until someone retains it again. A context that a
        foreign library already re-created cannot be told apart this way; see
        docs/fault-model.md.

        Arguments and result: as ``Driver.check_context``.
        Raises:
            ContextLost: the primary context was reset from outside.
            InvalidRequest: ``ordinal`` is out of range.
            DriverError: the driver is closed.
        Thread rule: any thread.
        """
        dev = self._device(ordinal)
        if dev.token is None or dev.poisoned is not None:
            return  # not retained yet (nothing to lose), or poisoned (every call says so)
        if not dev.primary_active():
            set_thread_token(None)
            raise ContextLost(
                f"device {ordinal}: the primary context was reset from outside this driver; rebuild it",
                code="CUDA_ERROR_CONTEXT_IS_DESTROYED",
            )

    def order_foreign_stream(self, handle: int, after: CudaStream) -> None:
        """Make a stream this driver does not own (``handle``: a raw ``CUstream``, or 1/2 for
        the legacy/per-thread default streams) wait for everything queued on ``after`` so far.
        What a DLPack or CUDA Array Interface producer owes its consumer's stream.

        Args:
            handle: the foreign stream's raw handle.
            after: a stream of this driver.
        Raises:
            InvalidRequest: ``after`` is no stream of this driver.
            DriverError: CUDA refused the foreign handle, or ``after`` was closed or its context rebuilt.
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread.
        """
        stream = self._stream(after)
        event = stream.record_event()
        dev = stream._enter()
        (err,) = cu.cuStreamWaitEvent(cu.CUstream(int(handle)), event._cu, 0)
        if err != SUCCESS:
            # Not dev.fail: the foreign handle is not ours, so a refusal says nothing about our
            # context.
            raise error_for(err, f"device {dev.ordinal}: cuStreamWaitEvent(foreign stream {int(handle):#x})")

    def wait_foreign_stream(self, stream: CudaStream, handle: int) -> None:
        """Make ``stream`` wait for everything queued so far on a stream this driver does not own
        (``handle``: a raw ``CUstream``; 0 or 1 the legacy default stream, 2 the per-thread
        default stream). The reverse of :meth:`order_foreign_stream`: what a consumer owes work
        another library wrote on its own stream.

        Args:
            stream: a stream of this driver.
            handle: the foreign stream's raw handle.
        Raises:
            InvalidRequest: ``stream`` is no stream of this driver.
            DriverError: CUDA refused the foreign handle, or ``stream`` was closed or its context
                rebuilt.
            ContextPoisoned: the device saw a sticky error.
        Thread rule: any thread.
        """
        s = self._stream(stream)
        dev = s._enter()
        if dev.graveyard:
            dev.bury()  # outside the gate: it takes the device lock
        err, event = cu.cuEventCreate(EVENT_FLAGS)
        if err != SUCCESS:
            dev.fail(err, "cuEventCreate")
        try:
            (err,) = cu.cuEventRecord(event, cu.CUstream(int(handle)))
            if err != SUCCESS:
                # Not dev.fail: the foreign handle is not ours (see order_foreign_stream).
                raise error_for(err, f"device {dev.ordinal}: cuEventRecord(foreign stream {int(handle):#x})")
            with s._gate:
                dev = s._enter()
                (err,) = cu.cuStreamWaitEvent(s._cu, event, 0)
            if err != SUCCESS:
                dev.fail(err, f"cuStreamWaitEvent(stream {s._id})")
        finally:
            # The wait captured the event's state when it was enqueued; CUDA frees the event once
            # the recorded work is done.
            cu.cuEventDestroy(event)

    def rebuild_context(self, ordinal: int) -> None:
        """Synchronize what can be, then free and destroy everything this driver made in the
        context (allocations, pool blocks, streams, events, modules), give the pool's free memory
        back, and start a new epoch in the same primary context. Old streams and events raise
        ``DriverError`` (``CUDA_ERROR_INVALID_HANDLE``) from then on. ``ContextPoisoned`` when a
        sticky error was seen (or surfaces while synchronizing): CUDA cannot recover in-process.

        The primary context is not reset: it is the whole process's, and other users of it
        (PyTorch, CuPy, other drivers) keep their objects and go on working. After a reset from
        outside (the context already went, and our handles with it), nothing old is touched and
        a fresh primary context is retained.

        Arguments and result: as ``Driver.rebuild_context``.
        Raises:
            ContextPoisoned: a sticky error was seen, or surfaces while synchronizing.
            InvalidRequest: ``ordinal`` is out of range.
            DriverError: the driver is closed.
        Thread rule: any thread; work racing it on the device's streams either ran before (and was
        waited for) or is refused.
        """
        self._device(ordinal).rebuild()

    def close(self) -> None:
        """Wait for each retained context's work, destroy what this driver made in it, and release
        the retains. Idempotent; never raises (best effort: a poisoned context cannot do better).

        Thread rule: any thread; concurrent calls close once.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.free_pinned_leftovers()  # before the contexts go: a context takes its pinned memory with it
        for dev in self._devices:
            dev.close()


if TYPE_CHECKING:
    # Checked by mypy, never run: CudaDriver implements the driver protocol with its own stream
    # and event types, with no override left unchecked.
    _IMPLEMENTS: type[Driver[CudaStream, CudaEvent]] = CudaDriver
