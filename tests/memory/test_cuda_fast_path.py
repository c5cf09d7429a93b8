"""The compiled core's CUDA fast path (``CudaOps``, and a library actor's ``EnqueueCore`` over it),
run without a GPU.

The entry points ``CudaOps`` calls are C function pointers; here they point at ctypes callbacks
that play a CUDA driver, and the stream, event and device objects are stand-ins carrying exactly
the attributes ``CudaDriver.fast_path`` documents. That shows on every machine which calls take
the C path, which fall back to the Python driver (closed stream, rebuilt context, a thread where
the context is not current, a foreign event), and that a failed C call is mapped by the device's
``fail`` and leaves the resource as it was. The GPU suite runs the same paths on libcuda.
"""

from __future__ import annotations

import ctypes
import struct
import threading
import weakref
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from xlog_actors._core.context_core import ContextCore
from xlog_actors._core.handles import HandleCore, TokenCell, make_handle
from xlog_actors._core.library_core import EnqueueCore
from xlog_actors._core.ops import ops_for
from xlog_actors.actors.library_messages import BufferArg, In, Launch, Out
from xlog_actors.driver.cuda.context import Stamped
from xlog_actors.driver.kernel import Kernel
from xlog_actors.errors import ContextLost, DriverError, OutOfMemory
from xlog_actors.memory import AsyncCudaResource, DirectCudaResource
from xlog_actors.memory.block import Access, AllocTag, BlockId, StreamId
from xlog_actors.memory.pinned import PinnedBuffer, _PinnedMemory

_ALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_size_t, ctypes.c_void_p,
                          ctypes.c_void_p)
_FREE_ASYNC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_ulonglong, ctypes.c_void_p)
_RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_WAIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
_MEM_ALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_size_t)
_MEM_FREE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_ulonglong)
_GRAPH_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_QUERY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_NODE_SET = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_KERNEL_SET = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_PRIMARY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_int))
_MEMSET = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_void_p)
_HTOD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_DTOH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_void_p)
_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *([ctypes.c_uint] * 7), ctypes.c_void_p,
                           ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)

OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY's value


class FakeCuda:
    """The entry points as C callbacks, logging each call; ``fail_next`` makes the next call
    return that error code."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.fail_next = 0
        self._next_ptr = 0x10000
        self.callbacks = {
            "cuMemAllocFromPoolAsync": _ALLOC(self._alloc_from_pool),
            "cuMemFreeAsync": _FREE_ASYNC(lambda p, s: self._call("free_async", p, s)),
            "cuEventRecord": _RECORD(lambda e, s: self._call("record", e, s)),
            "cuStreamWaitEvent": _WAIT(lambda s, e, f: self._call("wait", s, e)),
            "cuMemAlloc": _MEM_ALLOC(self._mem_alloc),
            "cuMemFree": _MEM_FREE(lambda p: self._call("mem_free", p)),
            "cuGraphLaunch": _GRAPH_LAUNCH(lambda g, s: self._call("graph_launch", g, s)),
            "cuEventQuery": _QUERY(self._query),
            "cuGraphExecMemcpyNodeSetParams": _NODE_SET(lambda g, n, p, c: self._call("node_set", g, n, p, c)),
            "cuGraphExecKernelNodeSetParams": _KERNEL_SET(lambda g, n, p: self._call("kernel_set", g, n, p)),
            "cuDevicePrimaryCtxGetState": _PRIMARY(self._primary_state),
            "cuMemsetD8Async": _MEMSET(lambda p, b, n, s: self._call("memset", p, b, n, s)),
            "cuMemcpyHtoDAsync": _HTOD(lambda d, h, n, s: self._call("htod", d, h, n, s)),
            "cuMemcpyDtoHAsync": _DTOH(lambda h, d, n, s: self._call("dtoh", h, d, n, s)),
            "cuLaunchKernel": _LAUNCH(self._launch),
        }
        #: The parameter kinds of the next launches, to read their packed values back.
        self.launch_kinds: tuple[str, ...] = ()
        self.primary_active = 1
        self.events_fired = True  # False: every query answers CUDA_ERROR_NOT_READY
        self.entry_points = {name: ctypes.cast(cb, ctypes.c_void_p).value for name, cb in self.callbacks.items()}

    def _primary_state(self, dev: int, flags: Any, active: Any) -> int:
        self.log.append(("primary_state", dev))
        active[0] = self.primary_active
        err, self.fail_next = self.fail_next, 0
        return err

    def _query(self, event: int) -> int:
        err = self._call("query", event)
        return err if err or self.events_fired else 600

    def _call(self, *entry: Any) -> int:
        self.log.append(entry)
        err, self.fail_next = self.fail_next, 0
        return err

    def _launch(self, fn: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int, stream: int,
                params: Any, extra: Any) -> int:
        codes = {"ptr": "Q", "u64": "Q", "i64": "q", "u32": "I", "i32": "i", "f32": "f", "f64": "d"}
        values = []
        for i, kind in enumerate(self.launch_kinds):
            code = codes[kind]
            raw = ctypes.string_at(params[i], struct.calcsize(code))
            values.append(struct.unpack("<" + code, raw)[0])
        return self._call("launch", fn, (gx, gy, gz), (bx, by, bz), shared, stream, tuple(values), extra)

    def _alloc_from_pool(self, out: Any, size: int, pool: Any, stream: Any) -> int:
        err = self._call("alloc_from_pool", size, pool, stream)
        if not err:
            out[0] = self._next_ptr
            self._next_ptr += 0x1000
        return err

    def _mem_alloc(self, out: Any, size: int) -> int:
        err = self._call("mem_alloc", size)
        if not err:
            out[0] = self._next_ptr
            self._next_ptr += 0x1000
        return err


class FakeDevice(Stamped):
    """A device stand-in; ``Stamped`` keeps ``CudaDevice``'s version-cell contract."""

    def __init__(self) -> None:
        self.ordinal = 0
        self.token: object = object()
        self.epoch = 1
        self.epoch_token: object = object()
        self.poisoned: str | None = None
        self.pool = 0xF00
        self.pool_live: set[int] = set()
        self.direct_live: set[int] = set()
        self.failed: list[Any] = []
        self.cudev = 7
        self.functions: dict[Any, int] = {}

    def fail(self, err: object, what: str, requested: int = 0) -> None:
        self.failed.append((err, what))
        if err == OOM:
            raise OutOfMemory(f"device 0: {what}", requested=requested)
        raise DriverError(f"device 0: {what}: error {err}", code=f"CUresult({err})")


class FakeStream:
    def __init__(self, dev: FakeDevice, handle: int, sid: int) -> None:
        self._dev, self._epoch, self._closed, self._handle, self._id = dev, dev.epoch, None, handle, sid
        self._live: object | None = dev.epoch_token


class FakeEvent:
    def __init__(self, dev: FakeDevice, handle: int) -> None:
        self._dev, self._epoch, self._h, self._live = dev, dev.epoch, handle, dev.epoch_token


class FakeCudaDriver:
    """The Python side: every method counts as the slow path and does its work in Python.
    ``set_token`` writes this thread's token and counts the write, as ``set_thread_token`` does
    for the CUDA driver (the core trusts a token it read while the count is unchanged)."""

    def __init__(self, cuda: FakeCuda, dev: FakeDevice, tls: threading.local) -> None:
        self.cuda, self.dev, self.tls = cuda, dev, tls
        self.token_writes = array("q", [0])
        self._closed = False
        self.slow: list[str] = []
        self._events = 0
        self._ptr = 0x900000

    def fast_path(self, ordinal: object) -> tuple[Any, ...] | None:
        if ordinal != 0:
            return None
        return (self.cuda.entry_points, self.dev, self.tls, FakeStream, FakeEvent, int, self.token_writes)

    def set_token(self, token: object) -> None:
        self.tls.token = token
        self.token_writes[0] += 1

    def alloc_async(self, nbytes: int, stream: Any) -> int:
        self.slow.append("alloc_async")
        self._ptr += 0x1000
        return self._ptr

    def free_async(self, ptr: int, stream: Any) -> None:
        self.slow.append("free_async")

    def alloc(self, ordinal: int, nbytes: int) -> int:
        self.slow.append("alloc")
        self._ptr += 0x1000
        return self._ptr

    def free(self, ordinal: int, ptr: int) -> None:
        self.slow.append("free")

    def check_context(self, ordinal: int) -> None:
        self.slow.append("check_context")
        if not self.cuda.primary_active:
            raise ContextLost("device 0: the primary context was reset from outside this driver; rebuild it")

    def create_event(self, ordinal: int) -> FakeEvent:
        self._events += 1
        return FakeEvent(self.dev, 0xE000 + self._events)

    def pinned_view(self, ptr: int, nbytes: int) -> memoryview:
        return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")

    def fill(self, ptr: int, byte: int, nbytes: int, stream: Any) -> None:
        self.slow.append("fill")

    def launch(self, kernel: Any, grid: Any, block: Any, values: list[object], stream: Any) -> None:
        self.slow.append(f"launch {values}")


class FakePool:
    device_ordinal = 0

    def __init__(self, streams: dict[StreamId, Any]) -> None:
        self.streams = streams

    def resolve(self, sid: StreamId) -> Any:
        return self.streams.get(sid)


@pytest.fixture
def rig() -> Any:
    cuda, dev, tls = FakeCuda(), FakeDevice(), threading.local()
    driver = FakeCudaDriver(cuda, dev, tls)
    driver.set_token(dev.token)  # the context is current in this thread
    s0, s1 = FakeStream(dev, 0x5000, 1), FakeStream(dev, 0x5100, 2)
    pool = FakePool({StreamId(0): s0, StreamId(1): s1})
    res = AsyncCudaResource(driver, 0, pool)  # type: ignore[arg-type]  # stand-ins, not a Driver
    return type("Rig", (), {"cuda": cuda, "dev": dev, "tls": tls, "driver": driver, "s0": s0, "s1": s1,
                            "res": res})


def test_a_live_stream_in_a_current_context_takes_the_c_path(rig: Any) -> None:
    block = rig.res.allocate(4096)
    rig.res.deallocate(block)
    assert rig.driver.slow == [], "no Python driver call on the fast path"
    assert rig.cuda.log == [("alloc_from_pool", 4096, 0xF00, 0x5000), ("free_async", block.ptr, 0x5000)]
    assert rig.dev.pool_live == set(), "the pool's live set follows the C calls"
    assert rig.res.pending_free_bytes() == 4096


@pytest.mark.parametrize(
    "why", ["closed", "rebuilt", "poisoned", "other thread", "device lost its context", "device changing"]
)
def test_anything_but_a_healthy_live_stream_goes_to_the_python_driver(rig: Any, why: str) -> None:
    if why == "closed":  # as CudaStream.close: liveness first
        rig.dev.assign_stamped(rig.s0, "_live", None)
        rig.s0._closed = "closed"
    elif why == "rebuilt":  # as CudaDevice._teardown
        rig.dev.epoch += 1
        rig.dev.epoch_token = object()
    elif why == "poisoned":
        rig.dev.poisoned = "CUDA_ERROR_ILLEGAL_ADDRESS"
    elif why == "other thread":
        rig.driver.set_token(None)
    elif why == "device changing":  # an assignment under way in another thread (see CudaDevice)
        rig.dev.version[0] += 1  # odd: the cell of an assignment not finished
    else:
        rig.dev.token = None
    block = rig.res.allocate(64)
    rig.res.deallocate(block)
    assert rig.driver.slow == ["alloc_async", "free_async"]
    assert rig.cuda.log == []


def test_the_context_check_is_one_c_call_and_the_driver_only_for_a_lost_context(rig: Any) -> None:
    ops = ops_for(rig.driver, 0)
    ops.check_context()
    assert rig.cuda.log == [("primary_state", 7)] and rig.driver.slow == []
    rig.cuda.primary_active = 0  # reset from outside: the driver raises the precise error
    with pytest.raises(ContextLost, match="reset from outside"):
        ops.check_context()
    assert rig.driver.slow == ["check_context"]
    rig.cuda.log.clear()
    rig.dev.poisoned = "CUDA_ERROR_ILLEGAL_ADDRESS"  # every call says so already: nothing to check
    ops.check_context()
    assert rig.cuda.log == [] and rig.driver.slow == ["check_context"]
    rig.dev.poisoned = None
    rig.driver._closed = True
    with pytest.raises(ContextLost):
        ops.check_context()  # a closed driver: its own check decides


def test_a_change_after_the_cache_was_filled_is_seen(rig: Any) -> None:
    rig.res.deallocate(rig.res.allocate(64))  # fills the cached view of the device
    assert rig.driver.slow == []
    rig.dev.poisoned = "CUDA_ERROR_ILLEGAL_ADDRESS"
    rig.res.allocate(64)
    assert rig.driver.slow == ["alloc_async"], "the moved version cell made the core re-read the device"
    rig.dev.pool_live = set()  # a rebuild swaps the live set: the core must add to the new one
    rig.dev.poisoned = None
    block = rig.res.allocate(64)
    assert rig.dev.pool_live == {block.ptr}


def test_a_stream_closed_after_its_verdict_was_cached_goes_to_the_python_driver(rig: Any) -> None:
    # The core remembers the last stream that passed; closing it (CudaStream.close and retire
    # assign ``_live`` through the device's version cell) must end that verdict.
    rig.res.deallocate(rig.res.allocate(64))
    assert rig.driver.slow == []
    block = rig.res.allocate(64)
    rig.dev.assign_stamped(rig.s0, "_live", None)
    rig.s0._closed = "closed"
    rig.res.deallocate(block)
    rig.res.allocate(64)
    assert rig.driver.slow == ["free_async", "alloc_async"], "a closed stream reached the C path"
    assert rig.cuda.log[-1][0] == "alloc_from_pool", "nothing was enqueued on the closed stream"


def test_an_assignment_under_way_after_the_cache_was_filled_goes_to_the_python_driver(rig: Any) -> None:
    rig.res.deallocate(rig.res.allocate(64))
    rig.dev.version[0] += 1  # another thread is between the two halves of an assignment
    rig.res.deallocate(rig.res.allocate(64))
    assert rig.driver.slow == ["alloc_async", "free_async"]
    rig.dev.version[0] += 1  # done (it changed nothing the core reads)
    rig.res.deallocate(rig.res.allocate(64))
    assert rig.driver.slow == ["alloc_async", "free_async"], "an even cell again: the C path"


def test_a_failed_c_call_is_mapped_by_the_device_and_changes_nothing(rig: Any) -> None:
    rig.cuda.fail_next = OOM
    with pytest.raises(OutOfMemory):
        rig.res.allocate(1 << 20)
    assert rig.dev.failed[0][0] == OOM and "cuMemAllocFromPoolAsync(1048576 bytes" in rig.dev.failed[0][1]
    assert rig.res.bytes_outstanding() == 0 and rig.dev.pool_live == set()
    block = rig.res.allocate(64)
    rig.cuda.fail_next = 1  # CUDA_ERROR_INVALID_VALUE on the free
    with pytest.raises(DriverError, match="cuMemFreeAsync"):
        rig.res.deallocate(block)
    assert rig.res.live_bytes() == 64 and rig.res.pending_free_bytes() == 0, "the block stays live"
    rig.res.deallocate(block)
    assert rig.res.pending_free_bytes() == 64


def test_cross_stream_tracking_records_and_waits_through_the_c_path(rig: Any) -> None:
    block = rig.res.allocate(256)  # on stream 0 (handle 0x5000)
    bid = BlockId.from_block(block)
    rig.cuda.log.clear()
    rig.res.prepare_block_use(bid, StreamId(1), Access.READ)
    rig.res.finish_block_use(bid, StreamId(1), Access.READ)
    fence, read = 0xE001, 0xE002
    assert rig.cuda.log == [("record", fence, 0x5000), ("wait", 0x5100, fence), ("record", read, 0x5100)]
    rig.cuda.log.clear()
    rig.res.deallocate(block)
    assert rig.cuda.log == [("wait", 0x5000, read), ("free_async", block.ptr, 0x5000)], (
        "the free waits for the cross-stream read; the fence was its own stream's"
    )
    assert rig.driver.slow == []


def test_a_stream_of_a_foreign_type_is_served_by_its_own_methods(rig: Any) -> None:
    calls: list[str] = []

    class Recording(FakeStream):
        def record(self, event: Any) -> None:
            calls.append("record")

        def wait(self, event: Any) -> None:
            calls.append("wait")

    s1 = Recording(rig.dev, 0x5100, 2)
    rig.res.stream_pool.streams[StreamId(1)] = s1
    block = rig.res.allocate(256)
    rig.res.prepare_block_use(BlockId.from_block(block), StreamId(1), Access.READ)
    assert calls == ["wait"], "a stream of a foreign type is served by its own methods"


def test_direct_allocation_takes_the_c_path_and_claims_its_pointer(rig: Any) -> None:
    res = DirectCudaResource(rig.driver, 0)  # type: ignore[arg-type]  # stand-ins, not a Driver
    block = res.allocate(4096)
    assert rig.dev.direct_live == {block.ptr}
    res.deallocate(block)
    assert rig.dev.direct_live == set() and rig.driver.slow == []
    assert [e[0] for e in rig.cuda.log] == ["mem_alloc", "mem_free"]
    rig.driver._closed = True
    res.deallocate(res.allocate(64))
    assert rig.driver.slow == ["alloc", "free"], "a closed driver answers through its Python methods"


def _in_thread(fn: Any) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(timeout=10)
    assert not t.is_alive()
    return out[0]


class _LocalWithDefault(threading.local):
    token: object = None  # a class attribute: read through getattr, not the thread's dict


@pytest.mark.parametrize("local_type", [threading.local, _LocalWithDefault])
def test_the_current_context_check_follows_each_thread(rig: Any, local_type: type) -> None:
    # The core keeps the last calling thread's dict of the thread-local marker; every other
    # thread, and every change in this one, must still be seen.
    tls = local_type()
    rig.driver.tls = tls
    rig.driver.set_token(rig.dev.token)
    res = AsyncCudaResource(rig.driver, 0, rig.res.stream_pool)
    res.deallocate(res.allocate(64))
    assert rig.driver.slow == []
    _in_thread(lambda: res.deallocate(res.allocate(64)))  # the context is not current there
    assert rig.driver.slow == ["alloc_async", "free_async"]

    def current_there() -> None:
        rig.driver.set_token(rig.dev.token)
        res.deallocate(res.allocate(64))

    _in_thread(current_there)
    res.deallocate(res.allocate(64))  # back in this thread, whose dict the core re-reads
    assert rig.driver.slow == ["alloc_async", "free_async"]
    rig.driver.set_token(None)  # as CudaDevice.fail after CUDA_ERROR_INVALID_CONTEXT
    res.deallocate(res.allocate(64))
    assert rig.driver.slow == ["alloc_async", "free_async"] * 2


def test_calls_on_alternating_streams_pass_each_its_own_handle(rig: Any) -> None:
    # The core keeps the last stream's handle; a call on another stream object reads its own.
    b0 = rig.res.allocate(64, StreamId(0))
    b1 = rig.res.allocate(64, StreamId(1))
    rig.res.deallocate(b0)
    s2 = FakeStream(rig.dev, 0x5200, 3)  # another stream object under the same id
    rig.res.stream_pool.streams[StreamId(1)] = s2
    rig.res.deallocate(b1)
    assert [(e[0], e[-1]) for e in rig.cuda.log] == [
        ("alloc_from_pool", 0x5000), ("alloc_from_pool", 0x5100), ("free_async", 0x5000), ("free_async", 0x5200)
    ]
    assert rig.driver.slow == []


@pytest.mark.timeout(60)
def test_threads_taking_turns_on_one_resource_each_get_their_own_context_check(
    driver: Any, run_threads: Callable[..., list[BaseException]]
) -> None:
    # On CUDA: the core keeps one thread's dict of the context marker at a time; threads that take
    # turns (a new thread's context is not current until its first call's slow path makes it so)
    # must each be checked against their own. Every pair must succeed and the counters add up.
    import xlog_actors as xa

    pool = xa.StreamPool(driver, 0)
    res = AsyncCudaResource(driver, 0, pool)
    barrier = threading.Barrier(4)

    def work() -> None:
        barrier.wait(timeout=30)
        for _ in range(200):
            res.deallocate(res.allocate(4096))

    errors = run_threads(work, 4, 30)
    assert not errors, errors
    assert res.live_bytes() == 0 and res.pending_free_bytes() == 800 * 4096
    res.reap_pending()
    assert res.bytes_outstanding() == 0
    pool.close()


def test_a_token_write_is_seen_by_the_next_call_with_the_token_cached(rig: Any) -> None:
    rig.res.deallocate(rig.res.allocate(64))  # caches this thread's token
    assert rig.driver.slow == []
    rig.driver.set_token(None)  # as CudaDevice.fail after CUDA_ERROR_INVALID_CONTEXT
    rig.res.deallocate(rig.res.allocate(64))
    assert rig.driver.slow == ["alloc_async", "free_async"]
    rig.driver.set_token(rig.dev.token)  # as CudaDevice.make_current
    rig.res.deallocate(rig.res.allocate(64))
    assert rig.driver.slow == ["alloc_async", "free_async"], "current again: the C path"


def test_the_cuda_driver_writes_a_thread_token_only_through_set_thread_token() -> None:
    # The core trusts a cached token while TOKEN_WRITES is unchanged: an uncounted write would
    # leave it trusting a token the thread no longer has.
    import inspect
    import re

    import xlog_actors.driver.cuda as package

    writes = []
    for path in sorted(Path(inspect.getfile(package)).parent.glob("*.py")):
        for line in path.read_text().splitlines():
            if re.search(r"\btls\.token\s*=[^=]|setattr\(\s*tls\b", line):
                writes.append(f"{path.name}: {line.strip()}")
    assert writes == ["current.py: tls.token = token"], writes  # set_thread_token's own


def test_every_function_that_sets_a_current_context_writes_the_threads_mark() -> None:
    """A cuCtxSetCurrent that leaves the thread's mark alone makes the next fast-path call trust
    a context that is no longer current (CUDA then refuses its handles): every function of the
    CUDA driver that calls it also calls set_thread_token."""
    import ast
    import inspect

    import xlog_actors.driver.cuda as package

    silent, seen = [], 0
    for path in sorted(Path(inspect.getfile(package)).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            called = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                      for n in ast.walk(node) if isinstance(n, ast.Call)}
            if "cuCtxSetCurrent" in called:
                seen += 1
                if "set_thread_token" not in called:
                    silent.append(f"{path.name}: {node.name}")
    assert seen >= 2 and not silent, silent


# -- a library actor's compiled path (``_core.library_core.EnqueueCore``) on the same stand-ins --


class _State:
    """A device state stand-in: the token cell a handle validates against."""

    def __init__(self, token: object) -> None:
        self.cell = TokenCell()
        self.cell.token = token


class _Context(ContextCore):
    """A device context of the stand-in driver: its handles' frees go nowhere."""

    def reclaim(self, block: Any) -> None:
        pass


KINDS = Kernel(name="k", source="", params=("ptr", "ptr", "i32", "u32", "i64", "u64", "f32", "f64"),
               host=lambda *_: None)


@pytest.fixture
def lib(rig: Any) -> Any:
    token = object()
    state = _State(token)
    ctx = _Context(rig.res, 0, weakref.ref(state), token, HandleCore)
    ctx.open = True
    ctx.driver, ctx.ordinal = rig.driver, 0  # type: ignore[attr-defined]
    core = EnqueueCore(ctx, rig.s0, StreamId(0), rig.res.prepare_block_use, rig.res.finish_block_use,
                       Access.READ, Access.WRITE, PinnedBuffer, BufferArg)
    blocks = [rig.res.allocate(4096), rig.res.allocate(4096)]
    refs = [make_handle(HandleCore, block, ctx) for block in blocks]
    host = ctypes.create_string_buffer(4096)
    buf = PinnedBuffer(_PinnedMemory(rig.driver, ctypes.addressof(host), 4096), rig.driver, 0, 4096,
                       AllocTag.UNTAGGED)  # type: ignore[arg-type]
    rig.cuda.log.clear()
    return type("Lib", (), {"core": core, "ctx": ctx, "state": state, "refs": refs, "blocks": blocks,
                            "host": host, "buf": buf, "address": ctypes.addressof(host)})


def test_a_fill_and_the_pinned_copies_go_to_libcuda(rig: Any, lib: Any) -> None:
    ptr = lib.blocks[0].ptr
    assert lib.core.fill(lib.refs[0], 9) is True
    assert ("memset", ptr, 9, 4096, 0x5000) in rig.cuda.log
    assert lib.core.to_device(lib.refs[0], lib.buf) is True
    assert ("htod", ptr, lib.address, 4096, 0x5000) in rig.cuda.log
    assert lib.core.kept() == 1, "the buffer's memory is kept until the copy ran"
    event = lib.core.to_host(lib.refs[0], lib.buf, 100)
    assert isinstance(event, FakeEvent)
    assert ("dtoh", lib.address, ptr, 100, 0x5000) in rig.cuda.log
    assert ("record", event._h, 0x5000) in rig.cuda.log
    lib.core.prune()  # the stand-in's queries answer done
    assert lib.core.kept() == 0
    assert rig.driver.slow == [], "no Python driver call"


def test_kept_copies_are_looked_at_once_past_the_slack_and_let_go_in_one_query(rig: Any, lib: Any) -> None:
    """Kept buffers are looked at only once more than ``KEEP_SLACK`` are kept (a look is an event
    query); one stream's events fire in order, so when the newest that may go has fired, one query
    lets all of them go, and none goes while its copy has not run."""
    from xlog_actors._core.library_core import KEEP_SLACK

    def queries() -> int:
        return sum(1 for entry in rig.cuda.log if entry[0] == "query")

    rig.cuda.events_fired = False
    for _ in range(KEEP_SLACK):
        assert lib.core.to_device(lib.refs[0], lib.buf) is True
    assert lib.core.kept() == KEEP_SLACK and queries() == 0, "no look before the slack is used"
    for _ in range(3):
        assert lib.core.to_device(lib.refs[0], lib.buf) is True
    assert lib.core.kept() == KEEP_SLACK + 3, "nothing let go before its copy ran"
    rig.cuda.events_fired = True
    rig.cuda.log.clear()
    assert lib.core.to_device(lib.refs[0], lib.buf) is True
    assert lib.core.kept() == 1 and queries() == 1, "all but the newest let go on one query"


def test_a_launch_packs_every_kind_as_the_driver_does(rig: Any, lib: Any) -> None:
    rig.dev.functions[KINDS] = 0xF1
    rig.cuda.launch_kinds = KINDS.params
    edges = (-(1 << 31), (1 << 32) - 1, -(1 << 63), (1 << 64) - 1, -1.5e38, 2.5e-300)
    msg = Launch(KINDS, 4, 128, [Out(lib.refs[0]), In(lib.refs[1]), *edges])
    assert lib.core.launch(msg) is False, "not learned yet"
    assert lib.core.learn(KINDS, 4, 128, ((4, 1, 1), (128, 1, 1))) is True
    assert lib.core.launch(msg) is True
    launches = [entry for entry in rig.cuda.log if entry[0] == "launch"]
    ptrs = (lib.blocks[0].ptr, lib.blocks[1].ptr)
    f32 = struct.unpack("<f", struct.pack("<f", -1.5e38))[0]
    assert launches == [("launch", 0xF1, (4, 1, 1), (128, 1, 1), 0, 0x5000, (*ptrs, *edges[:4], f32, edges[5]), None)]
    assert lib.refs[0]._last_write == StreamId(0) and lib.refs[1]._last_write is None
    assert rig.driver.slow == []
    other = Kernel(name="k2", source="", params=KINDS.params, host=lambda *_: None)
    assert lib.core.learn(other, 4, 128, ((4, 1, 1), (128, 1, 1))) is True
    assert lib.core.launch(Launch(other, 4, 128, msg.args)) is True  # not loaded: the driver's method
    assert rig.driver.slow == [f"launch {[*ptrs, *edges]}"]


def test_the_library_path_goes_to_the_driver_where_the_context_is_not_current(rig: Any, lib: Any) -> None:
    rig.driver.set_token(None)
    assert lib.core.fill(lib.refs[0], 1) is True
    assert rig.driver.slow[-1] == "fill" and not [e for e in rig.cuda.log if e[0] == "memset"]
