"""The CUDA driver: the driver protocol on ``cuda.bindings.driver`` (cuda-python).

What it is made of, and why:

* **Contexts.** The primary context of each ordinal (``cuDevicePrimaryCtxRetain``), the one
  CuPy, PyTorch and cuda.core share, retained lazily on the ordinal's first use and released by
  :meth:`CudaDriver.close`. A context is current per thread: every method makes its device's
  context current in the calling thread itself. A thread-local cache remembers which context
  *incarnation* (a token renewed on every retain) is current, so ``cuCtxSetCurrent`` runs only
  when it changes; :meth:`CudaDriver.make_current` always calls it (use it after foreign code
  changed the thread's context behind the driver's back).
* **Streams** are ``CU_STREAM_NON_BLOCKING``; each has a process-unique ``id`` (from 1: 0 is
  ``StreamId.DEFAULT``), ``ordinal`` and ``handle`` (the ``CUstream`` as an int), and exports
  ``__cuda_stream__`` so cuda.core and CuPy can use it.
* **Events** are ``CU_EVENT_DISABLE_TIMING`` only. ``CU_EVENT_BLOCKING_SYNC`` is deliberately not
  used: these events are the allocator's hot-path markers for ``cuStreamWaitEvent`` and
  ``cuEventQuery`` (one per cross-stream use), where it buys nothing, and the host blocks on them
  only in reaps and tests; there the context's scheduling policy applies exactly as it does to
  ``cuStreamSynchronize`` (spin while the process has fewer contexts than cores, else yield).
* **Memory.** ``alloc``/``free`` are the raw synchronous ``cuMemAlloc``/``cuMemFree`` (the
  sanitizer backend). ``alloc_async``/``free_async`` are stream-ordered on the device's default
  memory pool (``cuDeviceGetDefaultMemPool``) with ``CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`` at
  ``UINT64_MAX`` so freed memory stays cached. The allocation names that pool explicitly
  (``cuMemAllocFromPoolAsync``): the same as ``cuMemAllocAsync`` while the device's current pool
  is the default one, and still right if another library in the process switches the device's
  current pool.
* **Host buffers of async copies.** ``copy_to_device`` does not copy its source: from pageable
  memory ``cuMemcpyHtoDAsync`` returns once the bytes are staged (the caller may reuse its buffer
  at once), from page-locked memory it is truly asynchronous and the caller leaves the bytes alone
  until the copy ran, as with ``cudaMemcpyAsync``. The source, and the
  destination of ``copy_to_host``/``copy_to_host_into``, stay referenced by the stream until an
  event recorded right after the copy has fired (checked on later copies and at
  ``synchronize``), so no DMA ever touches freed host memory and the list stays short without a
  synchronize. A stream closed with copies in flight hands them to its device, which drops them as
  their events fire. Device-to-host copies into pageable memory may return only once the copy ran
  (CUDA's documented behaviour); pass a pinned buffer to ``copy_to_host_into`` for a truly
  asynchronous copy.
* **Kernels.** ``launch`` compiles ``kernel.source`` with NVRTC (``cuda.bindings.nvrtc``) into a
  cubin for the device's architecture, once per process per (kernel, architecture), and loads it
  into each context with ``cuModuleLoadData`` once per (context, kernel); arguments are packed by
  ``kernel.params`` (:data:`~xlog_actors.driver.kernel.PARAM_DTYPES`) into 8-byte slots and
  launched with ``cuLaunchKernel``. cuda.core's ``Program``/``launch`` are not used: ``Kernel.options``
  are raw NVRTC flags, which ``ProgramOptions`` cannot take, and cuda.core's context-independent
  ``CUlibrary`` kernels and stream wrappers do not fit a driver that must drop and rebuild every
  per-context module in ``rebuild_context``; here each of the two steps is a single call.
  ``sleep`` is such a kernel: one thread spinning on ``%globaltimer`` with ``__nanosleep``
  (wall-clock microseconds whatever the SM clock).
* **Errors.** Every ``CUresult`` goes through :mod:`.cuda_errors`. A sticky error marks the device
  poisoned: every later call on it (``rebuild_context`` included) raises ``ContextPoisoned``
  without touching CUDA, which could not recover in this process anyway.

Thread rules: every method may be called from any thread. Each device has one re-entrant lock that
guards its context's lifecycle (retain, rebuild, close), its stream registry and its loaded
modules; the hot paths (allocation, copies, launches, event operations) take no device lock, only
the stream's own gate (below): they read the device's context token and a stream's epoch, and a
stream or event of an older epoch raises ``DriverError`` (``CUDA_ERROR_INVALID_HANDLE``) instead
of reaching CUDA with a dead handle. Each stream's gate (a lock held across its liveness check and
the CUDA call) makes work on a stream and a rebuild exclusive: the rebuild retires every stream
through its gate before it synchronizes and frees, so stream work racing it either ran before (and
was waited for) or is refused; none runs on freed memory. A synchronous ``free`` claims its
pointer from the live set first, so it and a rebuild's sweep never both free it; a synchronous
``alloc`` racing a rebuild is the caller's race to avoid (it may leak that block).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any, Final, Literal, NoReturn

import numpy as np
import numpy.typing as npt

from ..errors import (
    ContextLost,
    ContextPoisoned,
    DeviceUnavailable,
    DriverError,
    InvalidRequest,
    OutOfMemory,
    XlogError,
)
from .checks import (
    check_kernel_args,
    check_microseconds,
    check_nbytes,
    check_ordinal,
    writable_bytes,
)
from .cuda_errors import STICKY_CODES, error_for, result_name
from .kernel import PARAM_DTYPES, Kernel
from .protocol import Buffer

try:
    from cuda.bindings import driver as cu

    _IMPORT_ERROR: str | None = None
except ImportError as _exc:  # pragma: no cover - cuda-python is a dependency
    cu = None  # type: ignore[assignment]
    _IMPORT_ERROR = f"{type(_exc).__name__}: {_exc}"

__all__ = ["SLEEP_KERNEL", "CudaDriver", "CudaEvent", "CudaStream", "compile_cubin"]

if cu is not None:
    _SUCCESS: Any = cu.CUresult.CUDA_SUCCESS
    _NOT_READY: Any = cu.CUresult.CUDA_ERROR_NOT_READY
    _STREAM_FLAGS: Final[int] = int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
    _EVENT_FLAGS: Final[int] = int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
else:  # pragma: no cover
    _SUCCESS = 0
    _NOT_READY = 600
    _STREAM_FLAGS = 1
    _EVENT_FLAGS = 2

_UINT64_MAX: Final[int] = (1 << 64) - 1
# Codes of cuInit / cuDevicePrimaryCtxRetain meaning "this machine cannot give you the device".
_UNAVAILABLE_CODES: Final[frozenset[str]] = frozenset(
    {
        "CUDA_ERROR_NO_DEVICE",
        "CUDA_ERROR_INVALID_DEVICE",
        "CUDA_ERROR_DEVICE_UNAVAILABLE",
        "CUDA_ERROR_DEVICE_NOT_LICENSED",
        "CUDA_ERROR_INSUFFICIENT_DRIVER",
        "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
        "CUDA_ERROR_SYSTEM_NOT_READY",
        "CUDA_ERROR_NOT_INITIALIZED",
        "CUDA_ERROR_DEINITIALIZED",
    }
)
_SPARE_EVENTS: Final[int] = 32  # keep-alive events a stream keeps for reuse

# Which context incarnation is current in this thread (a device's ``token``), shared by every
# CudaDriver: CUDA has one current context per thread, whoever set it.
_tls = threading.local()
# Stream ids are process-unique (and so driver-unique); 0 is StreamId.DEFAULT.
_stream_ids = itertools.count(1)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _address(buf: Any) -> int:
    """The address of a contiguous buffer's first byte (``buf`` must stay referenced)."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def _check_ptr(ptr: object, what: str) -> int:
    # Mirrors the host driver: a pointer is a plain positive int. Range checks are CUDA's.
    if type(ptr) is not int or ptr <= 0:
        raise DriverError(f"{what}: {ptr!r} is not a device pointer", code="CUDA_ERROR_INVALID_VALUE")
    return ptr


def _dims(value: Sequence[int] | int, what: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, int) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(
        type(d) is not int and not isinstance(d, np.integer) or isinstance(d, bool) or d < 1
        for d in dims
    ):
        raise InvalidRequest(f"{what} must be a positive int or 1 to 3 positive ints, got {value!r}")
    full = tuple(int(d) for d in dims) + (1,) * (3 - len(dims))
    return full  # type: ignore[return-value]


# -- NVRTC ----------------------------------------------------------------------------------
_cubins: dict[tuple[str, str, str, tuple[str, ...]], bytes] = {}
_cubin_lock = threading.Lock()


def compile_cubin(source: str, name: str, arch: str, options: Sequence[str] = ()) -> bytes:
    """``source`` compiled by NVRTC into a cubin for ``arch`` (``"sm_90"``), cached per process.

    Raises ``DriverError`` naming ``libnvrtc`` when NVRTC cannot be loaded (``.code`` None: it is
    no driver error), and ``DriverError`` with the NVRTC result name and the compile log when the
    source does not compile. Thread-safe; compiles of different kernels are serialized (rare).
    """
    key = (source, name, arch, tuple(options))
    cubin = _cubins.get(key)
    if cubin is not None:
        return cubin
    with _cubin_lock:
        cubin = _cubins.get(key)
        if cubin is None:
            cubin = _nvrtc_compile(source, name, arch, tuple(options))
            _cubins[key] = cubin
    return cubin


def _nvrtc_unavailable(exc: BaseException) -> DriverError:
    return DriverError(
        "NVRTC is not available: libnvrtc (libnvrtc.so.13 or .12, from the CUDA toolkit or the "
        "nvidia-cuda-nvrtc wheel) could not be loaded, so kernels (launch, sleep) cannot be "
        f"compiled: {_first_line(exc)}",
        code=None,
    )


def _nvrtc_compile(source: str, name: str, arch: str, options: tuple[str, ...]) -> bytes:
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - part of cuda-bindings
        raise _nvrtc_unavailable(exc) from None
    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    try:
        err, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    except Exception as exc:  # noqa: BLE001 - cuda.pathfinder's DynamicLibNotFoundError & co.
        raise _nvrtc_unavailable(exc) from None
    if err != ok:
        raise DriverError(f"nvrtcCreateProgram({name}) failed: {err.name}", code=err.name)
    try:
        opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in options)]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err != ok:
            log = _nvrtc_log(nvrtc, prog)
            raise DriverError(
                f"NVRTC could not compile kernel {name} for {arch}: {err.name}\n{log}", code=err.name
            )
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        if err != ok:
            raise DriverError(f"nvrtcGetCUBINSize({name}) failed: {err.name}", code=err.name)
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        if err != ok:
            raise DriverError(f"nvrtcGetCUBIN({name}) failed: {err.name}", code=err.name)
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _nvrtc_log(nvrtc: Any, prog: Any) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or size <= 1:
        return ""
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    return log.rstrip(b"\0 ").decode(errors="replace")


_SLEEP_SOURCE: Final[str] = r"""
extern "C" __global__ void xlog_sleep_ns(unsigned long long ns) {
    // %globaltimer is wall-clock nanoseconds, so the spin lasts the time asked for whatever
    // the SM clock does (clock64 would stretch with a throttled clock).
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    now = start;
    while (now - start < ns) {
#if __CUDA_ARCH__ >= 700
        __nanosleep(1000);
#endif
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    }
}
"""


def _host_sleep(mem: object, grid: object, block: object, ns: int) -> None:  # pragma: no cover
    import time

    time.sleep(ns / 1e9)


#: The kernel behind :meth:`CudaDriver.sleep` (one thread; its argument is nanoseconds).
SLEEP_KERNEL: Final[Kernel] = Kernel(
    name="xlog_sleep_ns", source=_SLEEP_SOURCE, params=("u64",), host=_host_sleep
)


def _pack_args(kernel: Kernel, args: Sequence[object]) -> tuple[npt.NDArray[np.uint64], ...]:
    """``(slots, pointers)``: each argument in its own 8-byte slot of ``slots`` (every parameter
    kind fits, suitably aligned) and ``pointers`` the ``void*[]`` cuLaunchKernel reads. Both must
    stay referenced until the launch call returned (CUDA copies the values at launch)."""
    n = len(kernel.params)
    slots = np.zeros(n, dtype=np.uint64)
    for i, (kind, value) in enumerate(zip(kernel.params, args, strict=False)):
        dtype = PARAM_DTYPES.get(kind)
        if dtype is None:
            raise InvalidRequest(f"kernel {kernel.name}: unknown parameter kind {kind!r}")
        is_float = kind in ("f32", "f64")
        if isinstance(value, bool) or not isinstance(
            value, (int, np.integer) if not is_float else (int, float, np.integer, np.floating)
        ):
            raise InvalidRequest(
                f"kernel {kernel.name}: argument {i} ({kind}) must be "
                f"{'a real number' if is_float else 'an int'}, got {value!r}"
            )
        try:
            slots[i : i + 1].view(dtype)[0] = float(value) if is_float else int(value)
        except (OverflowError, ValueError) as exc:
            raise InvalidRequest(
                f"kernel {kernel.name}: argument {i} ({kind}) {value!r} does not fit: {exc}"
            ) from None
    pointers = np.arange(n, dtype=np.uint64) * np.uint64(8) + np.uint64(slots.ctypes.data)
    return slots, pointers


# -- devices --------------------------------------------------------------------------------
class _CudaDevice:
    """One ordinal of one :class:`CudaDriver`: its primary-context retain and what lives in it.

    Invariants: ``token is not None`` exactly while this driver holds a retain on the primary
    context (``ctx``) and the device is usable; ``epoch`` changes whenever this driver's objects
    in that context die (rebuild, close), so streams and events carry the epoch they were made
    in. ``incarnation`` changes only when the CUDA context itself goes (a reset from outside,
    the last release): handles of an older epoch but the same incarnation are still valid CUDA
    objects, which a garbage-collected event's finalizer relies on to have them destroyed.
    ``poisoned`` is the sticky code once seen; it never clears. Guarded by ``lock`` except for
    the reads the hot paths make (single attribute loads).
    """

    def __init__(self, ordinal: int, cudev: Any) -> None:
        self.ordinal = ordinal
        self.cudev = cudev
        self.owner: object = None  # the CudaDriver this device belongs to
        self.lock = threading.RLock()
        self.ctx: Any = None
        self.token: object | None = None
        self.epoch = 0
        self.incarnation = 0
        self.closed = False
        self.poisoned: str | None = None
        self.pool: Any = None
        # Allocations not yet freed, which a rebuild or close frees itself: it keeps the primary
        # context (other libraries of the process live in it), and even a primary-context reset
        # from outside leaves the default pool's blocks taken (the pool is a device object).
        self.pool_live: set[int] = set()
        self.direct_live: set[int] = set()
        self.streams: weakref.WeakSet[CudaStream] = weakref.WeakSet()
        self.modules: list[Any] = []
        self.functions: dict[Kernel, Any] = {}
        # (event, object) pairs of streams closed with copies in flight; dropped as they fire
        self.orphans: deque[tuple[Any, object]] = deque()
        self.orphan_lock = threading.Lock()
        # Handles of streams and events that were garbage-collected: finalizers never call
        # CUDA (they may run on any thread, inside any lock); the next create_* destroys them.
        self.graveyard: deque[tuple[int, int, Any, Any]] = deque()
        major = self._attribute("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR")
        minor = self._attribute("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR")
        self.arch = f"sm_{major}{minor}"

    def _attribute(self, name: str) -> int:
        err, value = cu.cuDeviceGetAttribute(getattr(cu.CUdevice_attribute, name), self.cudev)
        if err != _SUCCESS:
            self.fail(err, f"cuDeviceGetAttribute({name})")
        return int(value)

    # -- failure ----------------------------------------------------------------------------
    def fail(self, err: object, what: str, requested: int = 0) -> NoReturn:
        """Raise the typed error for ``err``; remember a sticky one."""
        exc = error_for(err, f"device {self.ordinal}: {what}", requested=requested)
        if getattr(exc, "code", None) == "CUDA_ERROR_INVALID_HANDLE":
            # Every handle this driver passes to CUDA is one it made and believes live (handles
            # of an older context are refused before CUDA sees them). CUDA refusing one means
            # the context was reset under us, by foreign code: the context is lost.
            exc = ContextLost(
                f"device {self.ordinal}: {what}: CUDA refused a live handle "
                "(CUDA_ERROR_INVALID_HANDLE): the context was reset from outside; rebuild it",
                code="CUDA_ERROR_INVALID_HANDLE",
            )
            _tls.token = None
        if isinstance(exc, ContextPoisoned):
            self.poisoned = exc.code
        elif isinstance(exc, OutOfMemory):
            with contextlib.suppress(Exception):  # best-effort detail on an error path
                e2, free, _total = cu.cuMemGetInfo()
                if e2 == _SUCCESS:
                    exc.free = int(free)
        elif getattr(exc, "code", None) in ("CUDA_ERROR_INVALID_CONTEXT", "CUDA_ERROR_CONTEXT_IS_DESTROYED"):
            # Perhaps foreign code changed this thread's context: set it again next time.
            _tls.token = None
        raise exc from None

    def poisoned_error(self) -> ContextPoisoned:
        return ContextPoisoned(
            f"device {self.ordinal}: context poisoned by a sticky error ({self.poisoned}); "
            "CUDA cannot recover it in this process",
            code=self.poisoned,
        )

    # -- context ----------------------------------------------------------------------------
    def enter(self) -> None:
        """Make this device's context current in the calling thread (hot path: two loads and a
        compare when it already is). Raises ``ContextPoisoned`` once poisoned, ``DriverError``
        once closed."""
        if self.poisoned is not None:
            raise self.poisoned_error()
        token = self.token
        if token is None:
            token = self.retain()
        if getattr(_tls, "token", None) is not token:
            self.set_current()

    def set_current(self) -> None:
        (err,) = cu.cuCtxSetCurrent(self.ctx)
        if err != _SUCCESS:
            _tls.token = None
            self.fail(err, "cuCtxSetCurrent")
        _tls.token = self.token

    def retain(self) -> object:
        """Retain the primary context (first use, or after a rebuild), make it current here, and
        set up its memory pool. On failure nothing stays retained."""
        with self.lock:
            if self.closed:
                raise DriverError("the CUDA driver is closed", code="CUDA_ERROR_DEINITIALIZED")
            if self.poisoned is not None:
                raise self.poisoned_error()
            if self.token is not None:
                return self.token
            err, ctx = cu.cuDevicePrimaryCtxRetain(self.cudev)
            if err != _SUCCESS:
                code = result_name(err)
                if code in _UNAVAILABLE_CODES:
                    raise DeviceUnavailable(
                        f"device {self.ordinal}: cuDevicePrimaryCtxRetain failed: {code}"
                    ) from None
                self.fail(err, "cuDevicePrimaryCtxRetain")
            self.ctx = ctx
            try:
                return self._activate()
            except BaseException:
                cu.cuDevicePrimaryCtxRelease(self.cudev)
                self.ctx = None
                _tls.token = None
                raise

    def _activate(self) -> object:
        """Under ``lock``, ``ctx`` retained: make it current here, set its pool up, and issue the
        token of a new epoch's objects."""
        (err,) = cu.cuCtxSetCurrent(self.ctx)
        if err != _SUCCESS:
            self.fail(err, "cuCtxSetCurrent")
        self.pool = self._setup_pool()
        token = object()
        self.token = token
        _tls.token = token
        return token

    def _setup_pool(self) -> Any:
        if not self._attribute("CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED"):
            return None  # alloc_async then raises CUDA_ERROR_NOT_SUPPORTED
        err, pool = cu.cuDeviceGetDefaultMemPool(self.cudev)
        if err != _SUCCESS:
            self.fail(err, "cuDeviceGetDefaultMemPool")
        # Keep freed memory cached in the pool instead of returning it at every synchronize.
        (err,) = cu.cuMemPoolSetAttribute(
            pool,
            cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            cu.cuuint64_t(_UINT64_MAX),
        )
        if err != _SUCCESS:
            self.fail(err, "cuMemPoolSetAttribute(RELEASE_THRESHOLD)")
        return pool

    def function(self, kernel: Kernel) -> Any:
        """``kernel``'s ``CUfunction`` in the current context: compiled once per process and
        architecture, loaded once per context. The caller has called :meth:`enter`."""
        fn = self.functions.get(kernel)
        if fn is not None:
            return fn
        # Compile outside the lock: NVRTC takes 100 ms or more and needs no context.
        cubin = compile_cubin(kernel.source, kernel.name, self.arch, kernel.options)
        with self.lock:
            self.enter()  # a rebuild may have run meanwhile: load into the context of now
            fn = self.functions.get(kernel)
            if fn is not None:
                return fn
            err, module = cu.cuModuleLoadData(cubin)
            if err != _SUCCESS:
                self.fail(err, f"cuModuleLoadData({kernel.name})")
            err, fn = cu.cuModuleGetFunction(module, kernel.name.encode())
            if err != _SUCCESS:
                cu.cuModuleUnload(module)
                self.fail(err, f"cuModuleGetFunction({kernel.name})")
            self.modules.append(module)
            self.functions[kernel] = fn
            return fn

    def bury(self) -> None:
        """Destroy the handles finalizers left in ``graveyard``: those of the current context
        incarnation (a rebuild keeps the context, so handles of older epochs are still valid;
        a stream's finalizer enqueues it only when nothing else retired it). Handles of an older
        incarnation died with it. Called on ordinary call paths, never from a finalizer."""
        with self.lock:
            graveyard = self.graveyard
            while graveyard:
                incarnation, _epoch, handle, stream_state = graveyard.popleft()
                if incarnation != self.incarnation or self.ctx is None:
                    continue
                if stream_state is None:
                    cu.cuEventDestroy(handle)
                    continue
                keep, spare = stream_state
                if keep:
                    with self.orphan_lock:
                        self.orphans.extend(keep)
                for event in spare:
                    cu.cuEventDestroy(event)
                cu.cuStreamDestroy(handle)

    def drop_orphans(self, *, destroy: bool) -> None:
        """Forget keep-alive entries of closed streams whose copies ran (all of them when the
        context is gone: nothing runs any more). ``destroy``: their events are still valid."""
        with self.orphan_lock:
            orphans = self.orphans
            if destroy:
                while orphans:
                    event = orphans[0][0]
                    if cu.cuEventQuery(event)[0] != _SUCCESS:
                        break
                    orphans.popleft()
                    cu.cuEventDestroy(event)
            else:
                orphans.clear()

    def _teardown(self, reason: str) -> list[CudaStream]:
        """Under ``lock``: invalidate every object this driver made in the context (epoch bump)
        and forget its per-context state. Returns the streams this call retired (their handles
        are the caller's to destroy, or to forget with a dead context).

        The streams are retired before the epoch and token change: a thread inside a stream's
        gate may still need the token (``enter``), and the gate is what this waits for."""
        streams = list(self.streams)
        retired = [stream for stream in streams if stream._invalidate(reason)]
        self.epoch += 1
        self.token = None
        self.streams = weakref.WeakSet()
        self.functions = {}
        self.pool = None
        return retired

    def _trim_pool(self, pool: Any = None) -> None:
        """Give the pool's unused memory back to the device. The release threshold keeps freed
        memory cached, and the default pool is a device object that outlives every context:
        without a trim, the memory a rebuild freed stays reserved (seen on an H200: 1 GiB of
        freed pool memory stayed taken). Best effort."""
        pool = pool if pool is not None else self.pool
        if pool is not None:
            with contextlib.suppress(Exception):
                cu.cuMemPoolTrimTo(pool, 0)

    def primary_active(self) -> bool:
        """Whether the primary context is active. False after a ``cuDevicePrimaryCtxReset``
        until someone retains it again: how a reset from outside is noticed. Uses only the
        device handle, which a reset leaves valid."""
        err, _flags, active = cu.cuDevicePrimaryCtxGetState(self.cudev)
        return err != _SUCCESS or bool(active)

    def _free_pool_leftovers(self) -> None:
        """Free the stream-ordered allocations still live at a rebuild or close. Even a
        primary-context reset frees ``cuMemAlloc`` memory but not the default pool's blocks
        (seen on an H200: a 1 GiB ``cuMemAllocFromPoolAsync`` block stayed taken after the
        reset, trim or not). Best effort: in a lost context the frees may fail, and then there
        is nothing more to do."""
        live, self.pool_live = self.pool_live, set()
        if not live:
            return
        legacy = cu.CUstream(0)
        for ptr in live:
            with contextlib.suppress(Exception):
                cu.cuMemFreeAsync(ptr, legacy)
        with contextlib.suppress(Exception):
            cu.cuCtxSynchronize()

    def _free_direct_leftovers(self) -> None:
        """Free the ``cuMemAlloc`` allocations still live (the context is kept, so nothing else
        would). Best effort, like :meth:`_free_pool_leftovers`."""
        live, self.direct_live = self.direct_live, set()
        while live:
            try:
                ptr = live.pop()  # atomic, like the claim in CudaDriver.free: one of us frees it
            except KeyError:
                break
            with contextlib.suppress(Exception):
                cu.cuMemFree(ptr)

    def _release_everything(self, reason: str) -> None:
        """Under ``lock``, the context usable: free and destroy everything this driver made in it
        (allocations, streams and their events, modules, garbage-collected handles) and
        invalidate the wrappers with ``reason``. What other users of the primary context made
        stays untouched. Order matters: the streams are retired first (each waits for an
        enqueue in flight on it, and refuses any later one), then the context's work is waited
        for, and only then is memory freed, so no work of ours can run on freed memory. Best
        effort past the synchronize, which raises ``ContextPoisoned`` on a sticky error."""
        self.bury()
        pool = self.pool
        streams = self._teardown(reason)
        try:
            self._sync_quietly()
            self._free_pool_leftovers()
            self._free_direct_leftovers()
            self._trim_pool(pool)  # the pool keeps freed memory cached: give it back
        finally:
            with contextlib.suppress(Exception):  # best effort
                for stream in streams:
                    stream._destroy_handles()
                for module in self.modules:
                    cu.cuModuleUnload(module)
                self.drop_orphans(destroy=True)
            self.modules = []

    def _sync_quietly(self) -> None:
        """Synchronize the context, ignoring non-sticky failures (a lost context has nothing to
        wait for); a sticky one poisons the device and raises."""
        (err,) = cu.cuCtxSetCurrent(self.ctx)
        if err == _SUCCESS:
            (err,) = cu.cuCtxSynchronize()
        if err != _SUCCESS and result_name(err) in STICKY_CODES:
            self.fail(err, "cuCtxSynchronize")

    def rebuild(self) -> None:
        """See :meth:`CudaDriver.rebuild_context`."""
        with self.lock:
            if self.closed:
                raise DriverError("the CUDA driver is closed", code="CUDA_ERROR_DEINITIALIZED")
            if self.poisoned is not None:
                raise self.poisoned_error()
            if self.ctx is not None and not self.primary_active():
                # Foreign code reset the primary context: every handle of ours dangles, and
                # CUDA may crash on one rather than report it (seen on an H200). Touch none of
                # them: forget them, give our retain back, and retain a fresh context below.
                self._forget_context("context reset from outside")
                self.retain()
                # The pool is a device object: its blocks outlived the foreign reset. Free them
                # from the new context (best effort).
                self.set_current()
                self._free_pool_leftovers()
                self._trim_pool()
                return
            if self.ctx is None:
                self.retain()
                return
            # No primary-context reset: the context is the whole process's (PyTorch, CuPy and
            # any other library keep their objects in it), so only what this driver made goes.
            self._release_everything("context rebuilt")
            self._activate()

    def _forget_context(self, reason: str) -> None:
        """Under ``lock``, after the primary context went without us (a reset from outside):
        drop every handle of it unused, and our retain."""
        self._teardown(reason)
        self.incarnation += 1
        self.modules = []
        self.graveyard.clear()
        self.direct_live = set()  # the reset freed cuMemAlloc memory; pool blocks outlive it
        self.drop_orphans(destroy=False)
        cu.cuDevicePrimaryCtxRelease(self.cudev)
        self.ctx = None
        _tls.token = None

    def close(self) -> None:
        """Wait for the context's work, destroy this driver's streams and modules, release the
        retain. Never raises: closing is best effort (a poisoned context cannot do better)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if self.ctx is None:
                return
            if self.poisoned is None and self.primary_active():
                with contextlib.suppress(Exception):  # best effort
                    self._release_everything("driver closed")
            else:
                # Poisoned, or reset from outside (every handle dangles): touch none of them.
                self._teardown("driver closed")
                self.modules = []
            self.graveyard.clear()
            self.drop_orphans(destroy=False)
            with contextlib.suppress(Exception):  # best effort
                cu.cuDevicePrimaryCtxRelease(self.cudev)
            self.incarnation += 1  # perhaps the last release: the context may be gone
            self.ctx = None
            _tls.token = None


# -- events and streams ---------------------------------------------------------------------
class CudaEvent:
    """A ``CUevent`` (timing disabled) of one device's context incarnation.

    ``query()`` is True once the work before its latest record ran (or it was never recorded).
    An event of a context that was rebuilt or closed raises ``DriverError``
    (``CUDA_ERROR_INVALID_HANDLE``); its handle died with the context and is never passed to
    CUDA again. When garbage-collected its handle is destroyed by the device's next
    ``create_stream``/``create_event``/``record_event`` (finalizers never call CUDA).
    """

    __slots__ = ("__weakref__", "_cu", "_dev", "_epoch", "_incarnation")

    def __init__(self, dev: _CudaDevice, event: Any, epoch: int) -> None:
        self._dev = dev
        self._cu = event
        self._epoch = epoch
        self._incarnation = dev.incarnation

    @property
    def ordinal(self) -> int:
        return self._dev.ordinal

    @property
    def handle(self) -> int:
        """The ``CUevent`` as an int."""
        return int(self._cu)

    def _enter(self) -> _CudaDevice:
        dev = self._dev
        token = dev.token
        if (  # hot path: see CudaStream._enter
            self._epoch == dev.epoch
            and dev.poisoned is None
            and token is not None
            and getattr(_tls, "token", None) is token
        ):
            return dev
        if self._epoch != dev.epoch:
            if dev.poisoned is not None:
                raise dev.poisoned_error()
            raise DriverError(
                f"{self!r} belongs to a destroyed context (device {dev.ordinal} was rebuilt or closed)",
                code="CUDA_ERROR_INVALID_HANDLE",
            )
        dev.enter()
        return dev

    def query(self) -> bool:
        dev = self._enter()
        (err,) = cu.cuEventQuery(self._cu)
        if err == _SUCCESS:
            return True
        if err == _NOT_READY:
            return False
        dev.fail(err, "cuEventQuery")

    def synchronize(self) -> None:
        dev = self._enter()
        (err,) = cu.cuEventSynchronize(self._cu)
        if err != _SUCCESS:
            dev.fail(err, "cuEventSynchronize")

    def __repr__(self) -> str:
        return f"CudaEvent(device={self._dev.ordinal}, epoch={self._epoch})"

    def __del__(self) -> None:
        # No CUDA call here (any thread, perhaps inside one of our locks): the device destroys
        # the handle on its next create_* call, if the context that made it still exists (a
        # rebuild keeps it: the handle of an event of an older epoch is still valid).
        with contextlib.suppress(Exception):  # finalizers must not raise (interpreter exit)
            dev = self._dev
            if self._incarnation == dev.incarnation:
                dev.graveyard.append((self._incarnation, self._epoch, self._cu, None))


class CudaStream:
    """A non-blocking ``CUstream`` of one device's context incarnation.

    Work on it runs in order; ``wait`` orders it after an event without blocking the host.
    After its context is rebuilt or the driver closed, every method but ``close`` raises
    ``DriverError`` (``CUDA_ERROR_INVALID_HANDLE``). ``close`` destroys it once its queued work
    is done (``cuStreamDestroy`` semantics) and never blocks. Host buffers of copies in flight
    are kept referenced until those copies ran (see the module docstring).
    """

    __slots__ = (
        "__weakref__",
        "_closed",
        "_cu",
        "_dev",
        "_epoch",
        "_gate",
        "_handle",
        "_id",
        "_keep",
        "_lock",
        "_spare",
    )

    def __init__(self, dev: _CudaDevice, stream: Any, epoch: int) -> None:
        self._dev = dev
        self._cu = stream
        self._handle = int(stream)
        self._id = next(_stream_ids)
        self._epoch = epoch
        self._closed: str | None = None  # why, once closed, invalidated or collected
        # Held across "is this stream live?" and the CUDA call that uses its handle, and by
        # whoever retires the stream (a rebuild, close): so no thread can slip work onto a
        # stream, or onto memory, that a rebuild is about to free. Taken before ``_lock``,
        # never while waiting for the device lock.
        self._gate = threading.Lock()
        self._lock = threading.Lock()
        self._keep: deque[tuple[Any, object]] = deque()
        self._spare: list[Any] = []

    # -- protocol ---------------------------------------------------------------------------
    @property
    def id(self) -> int:
        return self._id

    @property
    def ordinal(self) -> int:
        return self._dev.ordinal

    @property
    def handle(self) -> int:
        return self._handle

    def __cuda_stream__(self) -> tuple[int, int]:
        """cuda.core's stream protocol: (version, handle)."""
        return (0, self._handle)

    def _enter(self) -> _CudaDevice:
        dev = self._dev
        token = dev.token
        # Hot path, the checks below and ``dev.enter()`` in one expression: a live stream of a
        # healthy context already current in this thread.
        if (
            self._epoch == dev.epoch
            and self._closed is None
            and dev.poisoned is None
            and token is not None
            and getattr(_tls, "token", None) is token
        ):
            return dev
        if self._epoch != dev.epoch or self._closed is not None:
            if dev.poisoned is not None:
                raise dev.poisoned_error()
            raise DriverError(
                f"{self!r} belongs to a destroyed context or was closed "
                f"({self._closed or 'context rebuilt'})",
                code="CUDA_ERROR_INVALID_HANDLE",
            )
        dev.enter()
        return dev

    def synchronize(self) -> None:
        with self._gate:
            dev = self._enter()
            (err,) = cu.cuStreamSynchronize(self._cu)
        if err != _SUCCESS:
            dev.fail(err, f"cuStreamSynchronize(stream {self._id})")
        if self._keep:
            with self._lock:
                self._prune_locked()

    def query(self) -> bool:
        with self._gate:
            dev = self._enter()
            (err,) = cu.cuStreamQuery(self._cu)
        if err == _SUCCESS:
            return True
        if err == _NOT_READY:
            return False
        dev.fail(err, f"cuStreamQuery(stream {self._id})")

    def record_event(self) -> CudaEvent:
        if self._dev.graveyard:
            self._enter().bury()  # outside the gate: it takes the device lock
        with self._gate:
            dev = self._enter()
            err, event = cu.cuEventCreate(_EVENT_FLAGS)
            if err != _SUCCESS:
                dev.fail(err, "cuEventCreate")
            wrapped = CudaEvent(dev, event, self._epoch)
            (err,) = cu.cuEventRecord(event, self._cu)
        if err != _SUCCESS:
            dev.fail(err, f"cuEventRecord(stream {self._id})")
        return wrapped

    def record(self, event: CudaEvent) -> None:  # type: ignore[override]
        if type(event) is not CudaEvent or event._dev is not self._dev:
            raise InvalidRequest(
                f"{self!r} can only record an event of its own device and driver, got {event!r}"
            )
        gate = self._gate
        gate.acquire()  # acquire/release: cheaper than ``with`` on this hot path
        try:
            dev = self._enter()
            event._enter()
            (err,) = cu.cuEventRecord(event._cu, self._cu)
        finally:
            gate.release()
        if err != _SUCCESS:
            dev.fail(err, f"cuEventRecord(stream {self._id})")

    def wait(self, event: CudaEvent) -> None:  # type: ignore[override]
        if type(event) is not CudaEvent:
            raise InvalidRequest(f"{self!r} can only wait on a CudaEvent, got {event!r}")
        gate = self._gate
        gate.acquire()
        try:
            dev = self._enter()
            if event._epoch != event._dev.epoch:
                event._enter()  # raises: the event's context is gone
            (err,) = cu.cuStreamWaitEvent(self._cu, event._cu, 0)
        finally:
            gate.release()
        if err != _SUCCESS:
            dev.fail(err, f"cuStreamWaitEvent(stream {self._id})")

    def close(self) -> None:
        with self._gate, self._lock:
            if self._closed is not None:
                return
            self._closed = "closed"
        dev = self._dev
        with dev.lock:
            dev.streams.discard(self)
            if self._epoch != dev.epoch or dev.token is None:
                return  # its context is gone, and the handles with it
            if not dev.primary_active():
                return  # reset from outside: the handles dangle, and CUDA may crash on them
            with self._lock:
                keep, self._keep = self._keep, deque()
                spare, self._spare = self._spare, []
            if keep:
                # Copies may still be reading or writing these buffers: the device holds them
                # until their events fire. The stream itself may go now.
                with dev.orphan_lock:
                    dev.orphans.extend(keep)
            with contextlib.suppress(Exception):  # close is best effort and idempotent
                for event in spare:
                    cu.cuEventDestroy(event)
                cu.cuStreamDestroy(self._cu)

    def __repr__(self) -> str:
        return f"CudaStream(device={self._dev.ordinal}, id={self._id}, epoch={self._epoch})"

    def __del__(self) -> None:
        # Like CudaEvent.__del__: hand the handles to the device instead of calling CUDA here.
        # Whoever flips ``_closed`` first (this, close, a rebuild's invalidation) owns the
        # handles' destruction: so a handle is never destroyed twice.
        with contextlib.suppress(Exception):  # finalizers must not raise
            if not self._lock.acquire(blocking=False):
                return  # someone is retiring it right now and will destroy it
            try:
                if self._closed is not None:
                    return
                self._closed = "collected"
            finally:
                self._lock.release()
            dev = self._dev
            state = (list(self._keep), list(self._spare))
            dev.graveyard.append((dev.incarnation, self._epoch, self._cu, state))

    # -- driver side ------------------------------------------------------------------------
    def _keep_until_done(self, obj: object) -> None:
        """Reference ``obj`` (a host buffer of the copy just enqueued) until the stream ran
        past this point: an event recorded now marks it. Older entries whose events fired are
        dropped on the way, so the list stays as long as the copies in flight."""
        dev = self._dev
        with self._lock:
            event = self._spare.pop() if self._spare else None
        if event is None:
            err, event = cu.cuEventCreate(_EVENT_FLAGS)
            if err != _SUCCESS:
                dev.fail(err, "cuEventCreate")
        (err,) = cu.cuEventRecord(event, self._cu)
        if err != _SUCCESS:
            # Without a marker we cannot know when the copy ran: wait for it instead.
            cu.cuEventDestroy(event)
            cu.cuStreamSynchronize(self._cu)
            dev.fail(err, f"cuEventRecord(stream {self._id})")
        with self._lock:
            self._keep.append((event, obj))
            self._prune_locked()
        if dev.orphans:
            dev.drop_orphans(destroy=True)

    def _prune_locked(self) -> None:
        keep = self._keep
        while keep:
            event = keep[0][0]
            if cu.cuEventQuery(event)[0] != _SUCCESS:
                break  # not yet (or a sticky error: keep everything, nothing runs any more)
            keep.popleft()
            if len(self._spare) < _SPARE_EVENTS:
                self._spare.append(event)
            else:
                cu.cuEventDestroy(event)

    def _invalidate(self, reason: str) -> bool:
        """Under the device lock, on rebuild or close: the stream is dead from now on. Waits for
        an enqueue in flight on it (the gate); True when this call retired it (its handles are
        then the caller's to destroy), False when it was already closed or collected."""
        with self._gate, self._lock:
            if self._closed is None:
                self._closed = reason
                return True
            return False

    def _destroy_handles(self) -> None:
        """Destroy the stream and its events while their context still exists (after a context
        synchronize, so no copy still uses a kept buffer). Errors are ignored: the context is
        about to go anyway."""
        with self._lock:
            keep, self._keep = self._keep, deque()
            spare, self._spare = self._spare, []
        with contextlib.suppress(Exception):  # best effort
            for event, _obj in keep:
                cu.cuEventDestroy(event)
            for event in spare:
                cu.cuEventDestroy(event)
            cu.cuStreamDestroy(self._cu)


# -- the driver -----------------------------------------------------------------------------
class CudaDriver:
    """The driver protocol on cuda-python. See the module docstring.

    Construction runs ``cuInit`` and counts devices; it raises ``DeviceUnavailable`` (with the
    reason, never a cuda-python traceback) when cuda-python or libcuda cannot be loaded,
    ``cuInit`` fails, or no device is visible. Contexts are retained on each ordinal's first use.
    """

    kind: Literal["cuda"] = "cuda"

    def __init__(self) -> None:
        if cu is None:
            raise DeviceUnavailable(
                f"cuda-python is not importable ({_IMPORT_ERROR}); install cuda-python>=13"
            )
        try:
            (err,) = cu.cuInit(0)
        except Exception as exc:  # noqa: BLE001 - cuda.pathfinder's DynamicLibNotFoundError & co.
            raise DeviceUnavailable(
                "the NVIDIA driver library libcuda could not be loaded, so no CUDA GPU is "
                f"reachable: {_first_line(exc)}"
            ) from None
        if err != _SUCCESS:
            raise DeviceUnavailable(f"cuInit failed: {result_name(err)}; no CUDA GPU is usable") from None
        err, count = cu.cuDeviceGetCount()
        if err != _SUCCESS:
            raise DeviceUnavailable(f"cuDeviceGetCount failed: {result_name(err)}") from None
        if count < 1:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            raise DeviceUnavailable(f"libcuda is loaded but sees no CUDA device{hint}")
        devices = []
        for ordinal in range(count):
            err, cudev = cu.cuDeviceGet(ordinal)
            if err != _SUCCESS:
                raise DeviceUnavailable(f"cuDeviceGet({ordinal}) failed: {result_name(err)}") from None
            try:
                devices.append(_CudaDevice(ordinal, cudev))
            except XlogError as exc:
                raise DeviceUnavailable(f"device {ordinal} cannot be queried: {exc}") from None
        for dev in devices:
            dev.owner = self
        self._devices: list[_CudaDevice] = devices
        self._closed = False
        self._close_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CudaDriver(device_count={len(self._devices)}{', closed' if self._closed else ''})"

    # -- gates ------------------------------------------------------------------------------
    def _device(self, ordinal: object) -> _CudaDevice:
        ordinal = check_ordinal(ordinal, len(self._devices), "the CUDA driver")
        if self._closed:
            raise DriverError("the CUDA driver is closed", code="CUDA_ERROR_DEINITIALIZED")
        return self._devices[ordinal]

    def _stream(self, stream: object) -> CudaStream:
        if type(stream) is not CudaStream:
            raise InvalidRequest(f"expected a CudaStream of this driver, got {stream!r}")
        dev = stream._dev
        if dev.ordinal >= len(self._devices) or self._devices[dev.ordinal] is not dev:
            raise InvalidRequest(f"{stream!r} belongs to another driver")
        return stream

    # -- queries ----------------------------------------------------------------------------
    def device_count(self) -> int:
        return len(self._devices)

    def device_name(self, ordinal: int) -> str:
        dev = self._device(ordinal)
        err, name = cu.cuDeviceGetName(256, dev.cudev)
        if err != _SUCCESS:
            dev.fail(err, "cuDeviceGetName")
        return bytes(name).split(b"\0", 1)[0].decode(errors="replace").strip()

    def compute_capability(self, ordinal: int) -> str:
        """The device's architecture as NVRTC names it (``"sm_90"``)."""
        return self._device(ordinal).arch

    def mem_info(self, ordinal: int) -> tuple[int, int]:
        dev = self._device(ordinal)
        dev.enter()
        err, free, total = cu.cuMemGetInfo()
        if err != _SUCCESS:
            dev.fail(err, "cuMemGetInfo")
        return int(free), int(total)

    def make_current(self, ordinal: int) -> None:
        """Make ``ordinal``'s context current in this thread, unconditionally (refreshes the
        thread-local cache, e.g. after foreign code switched contexts)."""
        dev = self._device(ordinal)
        dev.enter()
        dev.set_current()

    # -- streams and events -----------------------------------------------------------------
    def create_stream(self, ordinal: int) -> CudaStream:
        dev = self._device(ordinal)
        with dev.lock:  # the epoch read and the creation must not straddle a rebuild
            dev.enter()
            if dev.graveyard:
                dev.bury()
            err, handle = cu.cuStreamCreate(_STREAM_FLAGS)
            if err != _SUCCESS:
                dev.fail(err, "cuStreamCreate")
            stream = CudaStream(dev, handle, dev.epoch)
            dev.streams.add(stream)
        return stream

    def create_event(self, ordinal: int) -> CudaEvent:
        dev = self._device(ordinal)
        dev.enter()
        if dev.graveyard:
            dev.bury()
        epoch = dev.epoch
        err, event = cu.cuEventCreate(_EVENT_FLAGS)
        if err != _SUCCESS:
            dev.fail(err, "cuEventCreate")
        return CudaEvent(dev, event, epoch)

    # -- synchronous allocation -------------------------------------------------------------
    def alloc(self, ordinal: int, nbytes: int) -> int:
        nbytes = check_nbytes(nbytes)
        dev = self._device(ordinal)
        dev.enter()
        err, ptr = cu.cuMemAlloc(nbytes)
        if err != _SUCCESS:
            dev.fail(err, f"cuMemAlloc({nbytes} bytes)", nbytes)
        ptr = int(ptr)
        dev.direct_live.add(ptr)
        return ptr

    def free(self, ordinal: int, ptr: int) -> None:
        dev = self._device(ordinal)
        _check_ptr(ptr, f"device {ordinal}: free")
        dev.enter()
        # Claim the pointer first (set.remove is atomic): of a free racing a rebuild's sweep, or
        # a second free, exactly one reaches cuMemFree. A pointer this driver did not allocate
        # (or already freed) is refused: cuMemFree would free whatever lives there now.
        try:
            dev.direct_live.remove(ptr)
        except KeyError:
            raise DriverError(
                f"device {ordinal}: free of {ptr:#x}, which is not a live cuMemAlloc allocation of this driver",
                code="CUDA_ERROR_INVALID_VALUE",
            ) from None
        (err,) = cu.cuMemFree(ptr)
        if err != _SUCCESS:
            dev.fail(err, f"cuMemFree({ptr:#x})")

    # -- stream-ordered allocation ----------------------------------------------------------
    def alloc_async(self, nbytes: int, stream: CudaStream) -> int:  # type: ignore[override]
        if type(nbytes) is not int or nbytes <= 0:
            nbytes = check_nbytes(nbytes)
        s = stream if type(stream) is CudaStream else self._stream(stream)
        gate = s._gate
        gate.acquire()  # not ``with``: this is the hottest path, and acquire/release is cheaper
        try:
            dev = s._dev
            token = dev.token
            if not (  # the checks of _stream and CudaStream._enter in one expression
                dev.owner is self
                and s._epoch == dev.epoch
                and s._closed is None
                and dev.poisoned is None
                and token is not None
                and getattr(_tls, "token", None) is token
            ):
                dev = self._stream(s)._enter()  # the precise error, or a context to make current
            pool = dev.pool
            if pool is None:
                raise DriverError(
                    f"device {dev.ordinal} does not support stream-ordered memory pools",
                    code="CUDA_ERROR_NOT_SUPPORTED",
                )
            err, ptr = cu.cuMemAllocFromPoolAsync(nbytes, pool, s._cu)
        finally:
            gate.release()
        if err != _SUCCESS:
            dev.fail(err, f"cuMemAllocFromPoolAsync({nbytes} bytes, stream {s._id})", nbytes)
        ptr = int(ptr)
        dev.pool_live.add(ptr)
        return ptr

    def free_async(self, ptr: int, stream: CudaStream) -> None:  # type: ignore[override]
        s = stream if type(stream) is CudaStream else self._stream(stream)
        if type(ptr) is not int or ptr <= 0:
            _check_ptr(ptr, f"device {s.ordinal}: stream-ordered free")
        gate = s._gate
        gate.acquire()
        try:
            dev = s._dev
            token = dev.token
            if not (
                dev.owner is self
                and s._epoch == dev.epoch
                and s._closed is None
                and dev.poisoned is None
                and token is not None
                and getattr(_tls, "token", None) is token
            ):
                dev = self._stream(s)._enter()
            (err,) = cu.cuMemFreeAsync(ptr, s._cu)
        finally:
            gate.release()
        if err != _SUCCESS:
            dev.fail(err, f"cuMemFreeAsync({ptr:#x}, stream {s._id})")
        dev.pool_live.discard(ptr)

    # -- copies and work --------------------------------------------------------------------
    def copy_to_device(self, ptr: int, data: Buffer, stream: CudaStream) -> None:  # type: ignore[override]
        # No snapshot: from pageable memory cuMemcpyHtoDAsync returns only once the bytes are
        # staged, so the caller may reuse its buffer at once; from page-locked memory the copy is
        # truly asynchronous and, as with cudaMemcpyAsync, the caller leaves the bytes alone until
        # the copy ran. Either way the buffer stays referenced until then.
        view = memoryview(data).cast("B")
        s = self._stream(stream)
        _check_ptr(ptr, f"device {s.ordinal}: copy to device")
        nbytes = len(view)
        with s._gate:
            dev = s._enter()
            if nbytes == 0:
                return
            (err,) = cu.cuMemcpyHtoDAsync(ptr, _address(view), nbytes, s._cu)
            if err != _SUCCESS:
                dev.fail(err, f"cuMemcpyHtoDAsync({nbytes} bytes to {ptr:#x}, stream {s._id})")
            s._keep_until_done((view, data))

    def copy_to_host(self, ptr: int, nbytes: int, stream: CudaStream) -> bytearray:  # type: ignore[override]
        nbytes = check_nbytes(nbytes, "copy size")
        out = bytearray(nbytes)
        self.copy_to_host_into(ptr, out, stream)
        return out

    def copy_to_host_into(self, ptr: int, out: Buffer, stream: CudaStream) -> None:  # type: ignore[override]
        target = writable_bytes(out)
        s = self._stream(stream)
        _check_ptr(ptr, f"device {s.ordinal}: copy to host")
        nbytes = len(target)
        with s._gate:
            dev = s._enter()
            if nbytes == 0:
                return
            (err,) = cu.cuMemcpyDtoHAsync(_address(target), ptr, nbytes, s._cu)
            if err != _SUCCESS:
                dev.fail(err, f"cuMemcpyDtoHAsync({nbytes} bytes from {ptr:#x}, stream {s._id})")
            # The view pins the buffer (a bytearray cannot be resized under it) until the copy ran.
            s._keep_until_done(target)

    def copy_device_to_device(self, dst: int, src: int, nbytes: int, stream: CudaStream) -> None:  # type: ignore[override]
        nbytes = check_nbytes(nbytes, "copy size")
        s = self._stream(stream)
        _check_ptr(dst, f"device {s.ordinal}: device-to-device copy destination")
        _check_ptr(src, f"device {s.ordinal}: device-to-device copy source")
        with s._gate:
            dev = s._enter()
            (err,) = cu.cuMemcpyDtoDAsync(dst, src, nbytes, s._cu)
        if err != _SUCCESS:
            dev.fail(err, f"cuMemcpyDtoDAsync({nbytes} bytes {src:#x} -> {dst:#x}, stream {s._id})")

    def fill(self, ptr: int, byte: int, nbytes: int, stream: CudaStream) -> None:  # type: ignore[override]
        if type(byte) is not int or not 0 <= byte <= 255:
            raise InvalidRequest(f"fill byte must be an int in 0..255, got {byte!r}")
        nbytes = check_nbytes(nbytes, "fill size")
        s = self._stream(stream)
        _check_ptr(ptr, f"device {s.ordinal}: fill")
        with s._gate:
            dev = s._enter()
            (err,) = cu.cuMemsetD8Async(ptr, byte, nbytes, s._cu)
        if err != _SUCCESS:
            dev.fail(err, f"cuMemsetD8Async({nbytes} bytes at {ptr:#x}, stream {s._id})")

    def sleep(self, stream: CudaStream, microseconds: int) -> None:  # type: ignore[override]
        microseconds = check_microseconds(microseconds)
        self.launch(SLEEP_KERNEL, 1, 1, (int(microseconds * 1000),), stream)

    def launch(
        self,
        kernel: Kernel,
        grid: Sequence[int] | int,
        block: Sequence[int] | int,
        args: Sequence[object],
        stream: CudaStream,  # type: ignore[override]
    ) -> None:
        check_kernel_args(kernel, args)
        g = _dims(grid, "grid")
        b = _dims(block, "block")
        slots, pointers = _pack_args(kernel, args)
        s = self._stream(stream)
        fn = s._enter().function(kernel)  # outside the gate: loading may take the device lock
        params = int(pointers.ctypes.data) if len(pointers) else 0
        with s._gate:
            dev = s._enter()  # a rebuild since the lookup retired the stream (and the module)
            (err,) = cu.cuLaunchKernel(fn, g[0], g[1], g[2], b[0], b[1], b[2], 0, s._cu, params, 0)
        del slots  # referenced until here: cuLaunchKernel copied the argument values
        if err != _SUCCESS:
            dev.fail(err, f"cuLaunchKernel({kernel.name}, grid={g}, block={b}, stream {s._id})")

    # -- context lifetime -------------------------------------------------------------------
    def check_context(self, ordinal: int) -> None:
        """Raise ``ContextLost`` when ``ordinal``'s primary context was reset behind this driver's
        back (by another library's ``cuDevicePrimaryCtxReset``), before any of its now dangling
        handles reaches CUDA: CUDA does not report such a use, it may crash the process (seen on
        an H200: a segfault). One driver call on the *device* handle, which stays valid: after a
        reset the primary context is inactive until someone retains it again. A context that a
        foreign library already re-created cannot be told apart this way; see
        docs/fault-model.md."""
        dev = self._device(ordinal)
        if dev.token is None or dev.poisoned is not None:
            return  # not retained yet (nothing to lose), or poisoned (every call says so)
        if not dev.primary_active():
            _tls.token = None
            raise ContextLost(
                f"device {ordinal}: the primary context was reset from outside this driver; rebuild it",
                code="CUDA_ERROR_CONTEXT_IS_DESTROYED",
            )

    def order_foreign_stream(self, handle: int, after: CudaStream) -> None:
        """Make a stream this driver does not own (``handle``: a raw ``CUstream``, or 1/2 for
        the legacy/per-thread default streams) wait for everything queued on ``after`` so far.
        What a DLPack or CUDA Array Interface producer owes its consumer's stream."""
        stream = self._stream(after)
        event = stream.record_event()
        dev = stream._enter()
        (err,) = cu.cuStreamWaitEvent(cu.CUstream(int(handle)), event._cu, 0)
        if err != _SUCCESS:
            # Not dev.fail: the foreign handle is not ours, so a refusal says nothing about our
            # context.
            raise error_for(err, f"device {dev.ordinal}: cuStreamWaitEvent(foreign stream {int(handle):#x})")

    def wait_foreign_stream(self, stream: CudaStream, handle: int) -> None:
        """Make ``stream`` wait for everything queued so far on a stream this driver does not own
        (``handle``: a raw ``CUstream``; 0 or 1 the legacy default stream, 2 the per-thread
        default stream). The reverse of :meth:`order_foreign_stream`: what a consumer owes work
        another library wrote on its own stream."""
        s = self._stream(stream)
        dev = s._enter()
        if dev.graveyard:
            dev.bury()  # outside the gate: it takes the device lock
        err, event = cu.cuEventCreate(_EVENT_FLAGS)
        if err != _SUCCESS:
            dev.fail(err, "cuEventCreate")
        try:
            (err,) = cu.cuEventRecord(event, cu.CUstream(int(handle)))
            if err != _SUCCESS:
                # Not dev.fail: the foreign handle is not ours (see order_foreign_stream).
                raise error_for(err, f"device {dev.ordinal}: cuEventRecord(foreign stream {int(handle):#x})")
            with s._gate:
                dev = s._enter()
                (err,) = cu.cuStreamWaitEvent(s._cu, event, 0)
            if err != _SUCCESS:
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
        a fresh primary context is retained."""
        self._device(ordinal).rebuild()

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        for dev in self._devices:
            dev.close()
