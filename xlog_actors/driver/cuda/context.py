"""Device and context: one ordinal's primary-context retain and everything the driver made in it.

* **Contexts.** The primary context of each ordinal (``cuDevicePrimaryCtxRetain``), the one
  CuPy, PyTorch and cuda.core share, retained lazily on the ordinal's first use and released by
  ``CudaDriver.close``. A context is current per thread: every driver method makes its device's
  context current in the calling thread itself. A thread-local cache (:data:`tls`) remembers
  which context *incarnation* (a token renewed on every retain) is current, so
  ``cuCtxSetCurrent`` runs only when it changes; ``CudaDriver.make_current`` always calls it (use
  it after foreign code changed the thread's context behind the driver's back).
* **The memory pool.** Stream-ordered allocations come from the device's default memory pool
  (``cuDeviceGetDefaultMemPool``), set up here on every retain with
  ``CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`` at ``UINT64_MAX`` so freed memory stays cached. A device
  of a ``CudaDriver(ipc_pool=True)`` (``ipc_pool``) makes an IPC-capable pool of its own instead
  (:func:`.pool_ipc.create_pool`, same threshold) on every activation, and retires it with the
  context's other objects (rebuild, close).
* **Modules.** A kernel's cubin (see :mod:`.nvrtc`) is loaded into each context with
  ``cuModuleLoadData`` once per (context, kernel); ``rebuild`` unloads every module of the
  context it leaves.
* **Errors.** Every ``CUresult`` goes through :mod:`.call`. A sticky error marks the device
  poisoned: every later call on it (``rebuild`` included) raises ``ContextPoisoned`` without
  touching CUDA, which could not recover in this process anyway.
* **Rebuild and close** free and destroy everything this driver made in the context, in an order
  that lets no work of ours run on freed memory: retire every stream through its gate, wait for
  the context, free the live allocations, trim the pool, then destroy the handles and modules.
  The primary context itself is never reset: it is the whole process's.

This module is over 400 lines because it is one class, :class:`CudaDevice`, whose lock guards
the whole lifecycle of a context (retain, teardown, rebuild, close): the orderings between those
steps are the point, and they read best side by side.

Thread rule: every method may be called from any thread. The device's re-entrant ``lock`` guards
its context's lifecycle, its stream registry and its loaded modules; the hot paths take no device
lock and only read single attributes (``token``, ``epoch``, ``poisoned``).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from array import array
from collections import deque
from typing import TYPE_CHECKING, Any, Final, NoReturn, Protocol

from ...errors import ContextLost, ContextPoisoned, DeviceUnavailable, DriverError, OutOfMemory
from ..kernel import Kernel
from .call import STICKY_CODES, SUCCESS, cu, error_for, result_name
from .current import set_thread_token, tls
from .held import HeldCalls
from .nvrtc import compile_cubin
from .pool_ipc import create_pool, retire_pool

if TYPE_CHECKING:
    from typing_extensions import Self  # typing's is 3.11+; annotations are never evaluated here

__all__ = ["STAMPED_ATTRIBUTES", "CudaDevice", "DeviceStream", "Stamped", "tls"]

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

#: The attributes of a :class:`CudaDevice` the compiled core caches (see :class:`Stamped`).
STAMPED_ATTRIBUTES = frozenset({"epoch", "epoch_token", "token", "poisoned", "pool", "pool_live", "direct_live"})

class Stamped:
    """Keeps ``version``, a one-cell ``array('q')`` (a seqlock) that every assignment to one of
    :data:`STAMPED_ATTRIBUTES` moves by two: odd while the assignment is under way, even again
    once it is done. The compiled core holds a pointer to the cell and caches what it read of
    the device while the cell keeps the even value it saw: a reader that sees an odd value reads
    the attributes directly and caches nothing; one that sees a new even value re-reads them all
    (with the GIL held, so no assignment comes between, and it checks the cell again after).
    :meth:`assign_stamped` makes another object's assignment part of the same protocol (a
    stream of the device stopping being live). Test stand-ins of a device inherit the class to
    keep the same contract.

    Thread rule: any thread; writers are serialized by one module lock (reentrant: a finalizer
    run by an allocation inside a write may write too), readers take no lock.
    """

    version: array[int]

    def __new__(cls, *args: object, **kwargs: object) -> Self:  # the arguments are __init__'s
        self = super().__new__(cls)
        object.__setattr__(self, "version", array("q", [0]))
        return self

    def __setattr__(self, name: str, value: object) -> None:
        if name in STAMPED_ATTRIBUTES:
            self.assign_stamped(self, name, value)
        else:
            object.__setattr__(self, name, value)

    def assign_stamped(self, target: object, name: str, value: object) -> None:
        """``target.name = value`` as a change the compiled core's cached view must see.

        Args:
            target: this device, or an object whose attribute the core caches a verdict on (a
                stream's ``_live``).
            name: the attribute.
            value: its new value.
        Thread rule: any thread.
        """
        with _VERSION_LOCK:
            cell = self.version
            cell[0] += 1
            try:
                object.__setattr__(target, name, value)
            finally:
                cell[0] += 1


_VERSION_LOCK = threading.RLock()


class DeviceStream(Protocol):
    """What a device needs of the streams it holds (``CudaDevice.streams``; a
    :class:`.streams.CudaStream` is one): to retire them on a rebuild or close.

    A stream refers to its device and a device to its streams; the device names only this
    protocol, so :mod:`.streams` depends on this module and not the other way round.

    Thread rule: ``_invalidate`` runs under the device's lock; ``_destroy_handles`` after the
    stream was retired, while its context still exists.
    """

    def _invalidate(self, reason: str) -> bool: ...

    def _destroy_handles(self) -> None: ...


class CudaDevice(Stamped):
    """One ordinal of one :class:`CudaDriver`: its primary-context retain and what lives in it.

    Invariants: ``token is not None`` exactly while this driver holds a retain on the primary
    context (``ctx``) and the device is usable; ``epoch`` changes whenever this driver's objects
    in that context die (rebuild, close), so streams and events carry the epoch they were made
    in. ``incarnation`` changes only when the CUDA context itself goes (a reset from outside,
    the last release): handles of an older epoch but the same incarnation are still valid CUDA
    objects, which a garbage-collected event's finalizer relies on to have them destroyed.
    ``poisoned`` is the sticky code once seen; it never clears. Guarded by ``lock`` except for
    the reads the hot paths make (single attribute loads).

    ``version`` lets the compiled core cache the attributes its fast path reads
    (:data:`STAMPED_ATTRIBUTES`), through :class:`Stamped`.
    """

    def __init__(self, ordinal: int, cudev: Any, held: HeldCalls) -> None:
        self.ordinal = ordinal
        self.cudev = cudev
        self.owner: object = None  # the CudaDriver this device belongs to
        self.lock = threading.RLock()
        self.ctx: Any = None
        self.token: object | None = None
        self.held = held  # the driver's GIL-keeping calls (see .held)
        self.epoch = 0
        # A new object with every epoch: the streams and events of this epoch hold it in ``_live``
        # while usable, so the compiled core checks device, epoch and liveness by one identity.
        self.epoch_token: object = object()
        self.incarnation = 0
        self.closed = False
        self.poisoned: str | None = None
        self.pool: Any = None
        self.ipc_pool = False  # set by the CudaDriver: make an IPC-capable pool (see the module docstring)
        # Allocations not yet freed, which a rebuild or close frees itself: it keeps the primary
        # context (other libraries of the process live in it), and even a primary-context reset
        # from outside leaves the default pool's blocks taken (the pool is a device object).
        self.pool_live: set[int] = set()
        self.direct_live: set[int] = set()
        self.streams: weakref.WeakSet[DeviceStream] = weakref.WeakSet()
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
        #: the device reaches pinned host memory at its host address (graphs copy small host
        #: buffers with a kernel then: see ``graph_copies``)
        self.unified = bool(self._attribute("CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING"))

    def _attribute(self, name: str) -> int:
        err, value = cu.cuDeviceGetAttribute(getattr(cu.CUdevice_attribute, name), self.cudev)
        if err != SUCCESS:
            self.fail(err, f"cuDeviceGetAttribute({name})")
        return int(value)

    # -- failure ----------------------------------------------------------------------------
    def fail(self, err: object, what: str, requested: int = 0) -> NoReturn:
        """Raise the typed error for ``err``; remember a sticky one.

        Args:
            err: the failed call's ``CUresult``.
            what: the call and its subject (the device is prefixed).
            requested: bytes an allocation asked for.
        Raises:
            OutOfMemory, ContextPoisoned, ContextLost, DriverError: always; ``CUDA_ERROR_INVALID_HANDLE``
                becomes ``ContextLost``, as every handle passed to CUDA is one this driver believes live.
        Thread rule: any thread.
        """
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
            set_thread_token(None)
        if isinstance(exc, ContextPoisoned):
            self.poisoned = exc.code
        elif isinstance(exc, OutOfMemory):
            with contextlib.suppress(Exception):  # best-effort detail on an error path
                e2, free, _total = cu.cuMemGetInfo()
                if e2 == SUCCESS:
                    exc.free = int(free)
        elif getattr(exc, "code", None) in ("CUDA_ERROR_INVALID_CONTEXT", "CUDA_ERROR_CONTEXT_IS_DESTROYED"):
            # Perhaps foreign code changed this thread's context: set it again next time.
            set_thread_token(None)
        raise exc from None

    def poisoned_error(self) -> ContextPoisoned:
        """The error every call on a poisoned device raises (not raised here).

        Returns:
            ``ContextPoisoned`` naming the sticky code.
        Thread rule: any thread.
        """
        return ContextPoisoned(
            f"device {self.ordinal}: context poisoned by a sticky error ({self.poisoned}); "
            "CUDA cannot recover it in this process",
            code=self.poisoned,
        )

    # -- context ----------------------------------------------------------------------------
    def enter(self) -> None:
        """Make this device's context current in the calling thread (hot path: two loads and a
        compare when it already is). Raises ``ContextPoisoned`` once poisoned, ``DriverError``
        once closed.

        Raises:
            ContextPoisoned: the device saw a sticky error.
            DriverError: the driver is closed.
            DeviceUnavailable: the first retain finds the device unusable.
        Thread rule: any thread; acts on the calling thread.
        """
        if self.poisoned is not None:
            raise self.poisoned_error()
        token = self.token
        if token is None:
            token = self.retain()
        if getattr(tls, "token", None) is not token:
            self.set_current()

    def set_current(self) -> None:
        """Make ``ctx`` current in the calling thread, unconditionally, and note it in :data:`tls`.

        Raises:
            DriverError (or a subclass): ``cuCtxSetCurrent`` failed.
        Thread rule: any thread; acts on the calling thread.
        """
        (err,) = cu.cuCtxSetCurrent(self.ctx)
        if err != SUCCESS:
            set_thread_token(None)
            self.fail(err, "cuCtxSetCurrent")
        set_thread_token(self.token)

    def retain(self) -> object:
        """Retain the primary context (first use, or after a rebuild), make it current here, and
        set up its memory pool. On failure nothing stays retained.

        Returns:
            The token of the context's current epoch.
        Raises:
            DriverError: the driver is closed, or CUDA refused.
            ContextPoisoned: the device saw a sticky error.
            DeviceUnavailable: the machine cannot give this device.
        Thread rule: any thread; takes ``lock``.
        """
        with self.lock:
            if self.closed:
                raise DriverError("the CUDA driver is closed", code="CUDA_ERROR_DEINITIALIZED")
            if self.poisoned is not None:
                raise self.poisoned_error()
            if self.token is not None:
                return self.token
            err, ctx = cu.cuDevicePrimaryCtxRetain(self.cudev)
            if err != SUCCESS:
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
                set_thread_token(None)
                raise

    def _activate(self) -> object:
        """Under ``lock``, ``ctx`` retained: make it current here, set its pool up, and issue the
        token of a new epoch's objects."""
        (err,) = cu.cuCtxSetCurrent(self.ctx)
        if err != SUCCESS:
            self.fail(err, "cuCtxSetCurrent")
        self.pool = self._setup_pool()
        token = object()
        self.token = token
        set_thread_token(token)
        return token

    def _setup_pool(self) -> Any:
        if not self._attribute("CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED"):
            return None  # alloc_async then raises CUDA_ERROR_NOT_SUPPORTED
        if self.ipc_pool:
            if not self._attribute("CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES") & int(
                cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            ):
                raise DriverError(
                    f"device {self.ordinal}: its memory pools cannot be shared as POSIX file descriptors "
                    "(CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES); make the driver without ipc_pool",
                    code="CUDA_ERROR_NOT_SUPPORTED",
                )
            err, pool = create_pool(self.ordinal)
            if err != SUCCESS:
                self.fail(err, "cuMemPoolCreate(POSIX_FILE_DESCRIPTOR)")
        else:
            err, pool = cu.cuDeviceGetDefaultMemPool(self.cudev)
            if err != SUCCESS:
                self.fail(err, "cuDeviceGetDefaultMemPool")
        # Keep freed memory cached in the pool instead of returning it at every synchronize.
        (err,) = cu.cuMemPoolSetAttribute(
            pool,
            cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            cu.cuuint64_t(_UINT64_MAX),
        )
        if err != SUCCESS:
            retire_pool(pool)  # a no-op for the default pool
            self.fail(err, "cuMemPoolSetAttribute(RELEASE_THRESHOLD)")
        return pool

    def function(self, kernel: Kernel) -> Any:
        """``kernel``'s ``CUfunction`` in the current context: compiled once per process and
        architecture, loaded once per context. The caller has called :meth:`enter`.

        Args:
            kernel: the kernel to load.
        Returns:
            The ``CUfunction``.
        Raises:
            DriverError: NVRTC cannot compile it, or CUDA cannot load it.
        Thread rule: any thread; takes ``lock`` to load, never while holding a stream's gate.
        """
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
            if err != SUCCESS:
                self.fail(err, f"cuModuleLoadData({kernel.name})")
            err, fn = cu.cuModuleGetFunction(module, kernel.name.encode())
            if err != SUCCESS:
                cu.cuModuleUnload(module)
                self.fail(err, f"cuModuleGetFunction({kernel.name})")
            self.modules.append(module)
            self.functions[kernel] = fn
            return fn

    def bury(self) -> None:
        """Destroy the handles finalizers left in ``graveyard``: those of the current context
        incarnation (a rebuild keeps the context, so handles of older epochs are still valid;
        a stream's finalizer enqueues it only when nothing else retired it). Handles of an older
        incarnation died with it. Called on ordinary call paths, never from a finalizer.

        Thread rule: any thread but a finalizer; takes ``lock``, so never call it inside a stream's
        gate.
        """
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
        context is gone: nothing runs any more). ``destroy``: their events are still valid.

        Args:
            destroy: True while the context lives (query and destroy the events), False once it is gone.
        Thread rule: any thread; takes ``orphan_lock``.
        """
        with self.orphan_lock:
            orphans = self.orphans
            if destroy:
                while orphans:
                    event = orphans[0][0]
                    if cu.cuEventQuery(event)[0] != SUCCESS:
                        break
                    orphans.popleft()
                    cu.cuEventDestroy(event)
            else:
                orphans.clear()

    def _teardown(self, reason: str) -> list[DeviceStream]:
        """Under ``lock``: invalidate every object this driver made in the context (epoch bump)
        and forget its per-context state. Returns the streams this call retired (their handles
        are the caller's to destroy, or to forget with a dead context).

        The streams are retired before the epoch and token change: a thread inside a stream's
        gate may still need the token (``enter``), and the gate is what this waits for."""
        streams = list(self.streams)
        retired = [stream for stream in streams if stream._invalidate(reason)]
        self.epoch += 1
        self.epoch_token = object()
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
        device handle, which a reset leaves valid.

        Returns:
            True when active, or when the query itself fails (then nothing is known to be lost).
        Thread rule: any thread.
        """
        # A state read, once per actor message: the GIL is kept (see .held).
        code, is_active = self.held.primary_active(int(self.cudev))
        return code != 0 or is_active

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
            if pool is not None:
                retire_pool(pool, destroy=self.poisoned is None)  # an IPC pool of this epoch

    def _sync_quietly(self) -> None:
        """Synchronize the context, ignoring non-sticky failures (a lost context has nothing to
        wait for); a sticky one poisons the device and raises."""
        # The thread may have marked another device's context as its current one: unmark it, so
        # that the next call of that device makes its own context current again.
        set_thread_token(None)
        (err,) = cu.cuCtxSetCurrent(self.ctx)
        if err == SUCCESS:
            (err,) = cu.cuCtxSynchronize()
        if err != SUCCESS and result_name(err) in STICKY_CODES:
            self.fail(err, "cuCtxSynchronize")

    def rebuild(self) -> None:
        """See :meth:`CudaDriver.rebuild_context`.

        Raises:
            DriverError: the driver is closed.
            ContextPoisoned: the device saw a sticky error, or one surfaces while synchronizing.
        Thread rule: any thread; takes ``lock`` and every stream's gate in turn.
        """
        with self.lock:
            if self.closed:
                raise DriverError("the CUDA driver is closed", code="CUDA_ERROR_DEINITIALIZED")
            if self.poisoned is not None:
                raise self.poisoned_error()
            if self.ctx is not None and not self.primary_active():
                # Foreign code reset the primary context: every handle of ours dangles, and
                # CUDA may crash on one rather than report it (seen on an H200). Touch none of
                # them: forget them, give our retain back, and retain a fresh context below.
                old_pool = self.pool
                self._forget_context("context reset from outside")
                self.retain()
                # The pool is a device object: its blocks outlived the foreign reset. Free them
                # from the new context (best effort).
                self.set_current()
                self._free_pool_leftovers()
                self._trim_pool()
                if old_pool is not None:
                    retire_pool(old_pool)  # an IPC pool is a device object too: destroy it now
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
        set_thread_token(None)

    def close(self) -> None:
        """Wait for the context's work, destroy this driver's streams and modules, release the
        retain. Never raises: closing is best effort (a poisoned context cannot do better).

        Thread rule: any thread; takes ``lock`` and every stream's gate in turn.
        """
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
                if self.pool is not None:
                    retire_pool(self.pool, destroy=False)  # only its fd: no CUDA call
                self._teardown("driver closed")
                self.modules = []
            self.graveyard.clear()
            self.drop_orphans(destroy=False)
            with contextlib.suppress(Exception):  # best effort
                cu.cuDevicePrimaryCtxRelease(self.cudev)
            self.incarnation += 1  # perhaps the last release: the context may be gone
            self.ctx = None
            set_thread_token(None)

