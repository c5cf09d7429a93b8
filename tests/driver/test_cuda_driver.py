"""Tests of the CUDA driver (``xlog_actors.driver.cuda``) and its error classification.

Two kinds:

* tests that run everywhere (no GPU, no libcuda): construction failing with a clear
  ``DeviceUnavailable`` (the real failure where no GPU is reachable, and simulated failures
  everywhere), ``open_driver("auto")`` falling back to the host driver, the ``CUresult`` table,
  NVRTC missing, argument packing;
* ``@pytest.mark.gpu`` tests on a real device: round trips through both allocation paths, fill,
  events and cross-stream waits made observable with ``sleep``, OOM, kernel launches, many
  threads, and (in subprocesses, because they act on the process-wide primary context) context
  rebuilds and a real sticky error.

``XLOG_ACTORS_SANITIZER=1`` (set by ``scripts/gpu-check`` for its compute-sanitizer runs) skips
what deliberately faults and the negative control that needs truly concurrent streams.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import xlog_actors as xa
from xlog_actors.driver.cuda import (
    CONTEXT_LOST_CODES,
    STICKY_CODES,
    CudaDriver,
    CudaEvent,
    CudaStream,
    check,
    compile_cubin,
    error_class_for,
    error_for,
    result_name,
)
from xlog_actors.driver.cuda import driver as cuda_mod  # where CudaDriver() reads ``cu``
from xlog_actors.driver.open import DRIVER_ENV
from xlog_actors.errors import (
    ContextLost,
    ContextPoisoned,
    DeviceUnavailable,
    DriverError,
    InvalidRequest,
    OutOfMemory,
    XlogError,
)

cu = pytest.importorskip("cuda.bindings.driver")

REPO = Path(__file__).resolve().parents[2]
UNDER_SANITIZER = os.environ.get("XLOG_ACTORS_SANITIZER") == "1"
MiB = 1 << 20

# The ten codes CUDA documents as sticky (the context is unusable afterwards); the table may hold
# more, never fewer.
REQUIRED_STICKY = (
    "CUDA_ERROR_ILLEGAL_ADDRESS",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "CUDA_ERROR_MISALIGNED_ADDRESS",
    "CUDA_ERROR_INVALID_ADDRESS_SPACE",
    "CUDA_ERROR_INVALID_PC",
    "CUDA_ERROR_LAUNCH_FAILED",
    "CUDA_ERROR_HARDWARE_STACK_ERROR",
    "CUDA_ERROR_ASSERT",
    "CUDA_ERROR_LAUNCH_TIMEOUT",
    "CUDA_ERROR_ECC_UNCORRECTABLE",
)


@functools.cache
def gpu_present() -> bool:
    try:
        driver = CudaDriver()
    except DeviceUnavailable:
        return False
    driver.close()
    return True


needs_no_gpu = pytest.mark.skipif("gpu_present()", reason="a CUDA GPU is reachable here")


class FakeCu:
    """``cuda.bindings.driver`` with some functions replaced (to simulate broken machines)."""

    def __init__(self, **overrides: Any) -> None:
        self._overrides = overrides

    def __getattr__(self, name: str) -> Any:
        if name in self._overrides:
            return self._overrides[name]
        return getattr(cu, name)


def _not_found(*_args: object) -> Any:
    from cuda.pathfinder import DynamicLibNotFoundError

    raise DynamicLibNotFoundError('Failure finding "libcuda.so.1": simulated for a test')


# -- construction without a GPU -------------------------------------------------------------
@needs_no_gpu
def test_cuda_driver_unavailable_here_says_why() -> None:
    with pytest.raises(DeviceUnavailable) as info:
        CudaDriver()
    message = str(info.value)
    assert "libcuda" in message or "cuInit" in message or "no CUDA device" in message
    # Translated, not leaked: no cuda-python exception chained into the traceback.
    assert info.value.__cause__ is None and info.value.__suppress_context__
    with pytest.raises(DeviceUnavailable):
        xa.CudaDriver()
    with pytest.raises(DeviceUnavailable):
        xa.open_driver("cuda")


@needs_no_gpu
def test_auto_falls_back_to_host_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DRIVER_ENV, raising=False)
    for kind in ("auto", None):
        driver = xa.open_driver(kind)
        try:
            assert driver.kind == "host"
        finally:
            driver.close()


def test_missing_libcuda_is_device_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_mod, "cu", FakeCu(cuInit=_not_found))
    with pytest.raises(DeviceUnavailable, match="libcuda") as info:
        CudaDriver()
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert "simulated for a test" in str(info.value)
    with pytest.raises(DeviceUnavailable):
        xa.open_driver("cuda")
    monkeypatch.delenv(DRIVER_ENV, raising=False)
    driver = xa.open_driver("auto")
    try:
        assert driver.kind == "host"
    finally:
        driver.close()


def test_cuinit_failure_is_device_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    no_device = cu.CUresult.CUDA_ERROR_NO_DEVICE
    monkeypatch.setattr(cuda_mod, "cu", FakeCu(cuInit=lambda _flags: (no_device,)))
    with pytest.raises(DeviceUnavailable, match="CUDA_ERROR_NO_DEVICE"):
        CudaDriver()


def test_zero_devices_is_device_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    ok = cu.CUresult.CUDA_SUCCESS
    fake = FakeCu(cuInit=lambda _flags: (ok,), cuDeviceGetCount=lambda: (ok, 0))
    monkeypatch.setattr(cuda_mod, "cu", fake)
    with pytest.raises(DeviceUnavailable, match="no CUDA device"):
        CudaDriver()


def test_missing_cuda_python_is_device_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_mod, "cu", None)
    monkeypatch.setattr(cuda_mod, "IMPORT_ERROR", "ModuleNotFoundError: simulated")
    with pytest.raises(DeviceUnavailable, match="cuda-python"):
        CudaDriver()


def test_missing_nvrtc_names_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    from cuda.bindings import nvrtc

    monkeypatch.setattr(nvrtc, "nvrtcCreateProgram", _not_found)
    source = f"// unique {time.monotonic_ns()}\nextern \"C\" __global__ void k() {{}}\n"
    with pytest.raises(DriverError, match="libnvrtc") as info:
        compile_cubin(source, "k", "sm_90")
    assert info.value.code is None
    assert info.value.__cause__ is None and info.value.__suppress_context__


# -- the CUresult table ---------------------------------------------------------------------
def test_required_sticky_codes_are_sticky() -> None:
    for name in REQUIRED_STICKY:
        assert hasattr(cu.CUresult, name), name
        assert name in STICKY_CODES
    assert {"CUDA_ERROR_CONTEXT_IS_DESTROYED", "CUDA_ERROR_INVALID_CONTEXT"} <= CONTEXT_LOST_CODES


@pytest.mark.parametrize("result", [r for r in cu.CUresult if r.name != "CUDA_SUCCESS"], ids=lambda r: r.name)
def test_every_cuda_result_is_classified(result: Any) -> None:
    exc = error_for(result, "device 0: cuTest(1)", requested=4096)
    assert isinstance(exc, XlogError)
    assert str(exc).startswith("device 0: cuTest(1) failed: " + result.name)
    if result.name == "CUDA_ERROR_OUT_OF_MEMORY":
        assert type(exc) is OutOfMemory and exc.requested == 4096
    elif result.name in STICKY_CODES:
        assert type(exc) is ContextPoisoned and exc.code == result.name
        assert not isinstance(exc, DriverError)
    elif result.name in CONTEXT_LOST_CODES:
        assert type(exc) is ContextLost and exc.code == result.name
        assert isinstance(exc, DriverError)
    else:
        assert type(exc) is DriverError and exc.code == result.name
    assert error_class_for(result.name) is type(exc)


def test_check_is_silent_on_success_and_raises_typed() -> None:
    assert check(cu.CUresult.CUDA_SUCCESS, "anything") is None
    assert check(0, "anything") is None
    with pytest.raises(OutOfMemory) as oom:
        check(cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc(5 bytes)", requested=5)
    assert oom.value.requested == 5 and oom.value.__suppress_context__
    with pytest.raises(ContextPoisoned) as sticky:
        check(cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, "cuStreamSynchronize")
    assert sticky.value.code == "CUDA_ERROR_ILLEGAL_ADDRESS"
    with pytest.raises(DriverError) as plain:
        check(int(cu.CUresult.CUDA_ERROR_INVALID_VALUE), "cuMemFree")  # plain ints work too
    assert plain.value.code == "CUDA_ERROR_INVALID_VALUE"


def test_result_names() -> None:
    assert result_name(cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY) == "CUDA_ERROR_OUT_OF_MEMORY"
    assert result_name(2) == "CUDA_ERROR_OUT_OF_MEMORY"
    assert result_name(123456) == "CUresult(123456)"
    assert type(error_for(123456, "x")) is DriverError


# -- argument packing (pure) ----------------------------------------------------------------
def test_kernel_arguments_pack_into_slots() -> None:
    kernel = xa.Kernel(name="k", source="", params=("ptr", "f32", "i32", "u64", "f64"), host=print)
    slots, params = cuda_mod._pack_args(kernel, (0x7F00_0000_1000, 1.5, -3, (1 << 64) - 1, 2.25))
    raw = bytes(slots)
    assert raw[0:8] == np.uint64(0x7F00_0000_1000).tobytes()
    assert raw[8:12] == np.float32(1.5).tobytes()
    assert raw[16:20] == np.int32(-3).tobytes()
    assert raw[24:32] == np.uint64((1 << 64) - 1).tobytes()
    assert raw[32:40] == np.float64(2.25).tobytes()
    base = ctypes.addressof(slots)
    assert params == base + 40  # the void*[] after the five slots, each pointing at its slot
    assert list(np.frombuffer(raw[40:80], np.uint64) - np.uint64(base)) == [0, 8, 16, 24, 32]
    assert cuda_mod._pack_args(xa.Kernel(name="none", source="", params=(), host=print), ())[1] == 0
    # Out of f32 range: the infinity numpy (the host twin) rounds to, not a refusal.
    slots, _ = cuda_mod._pack_args(xa.Kernel(name="k", source="", params=("f32", "f32"), host=print), (1e39, -1e39))
    assert np.frombuffer(bytes(slots)[:16], np.float32)[[0, 2]].tolist() == [np.inf, -np.inf]


def test_each_thread_packs_into_slots_of_its_own() -> None:
    """A launch's slots are the thread's own: another thread's launch of the same kernel meanwhile
    leaves them alone (two actors launch on two streams at once)."""
    kernel = xa.Kernel(name="k", source="", params=("u64",), host=print)
    mine, params = cuda_mod._pack_args(kernel, (7,))
    other: list[Any] = []
    thread = threading.Thread(target=lambda: other.append(cuda_mod._pack_args(kernel, (9,))))
    thread.start()
    thread.join()
    assert other[0][0] is not mine and other[0][1] != params
    assert bytes(mine)[:8] == np.uint64(7).tobytes() and bytes(other[0][0])[:8] == np.uint64(9).tobytes()


@pytest.mark.parametrize(
    "args",
    [(1 << 31, 0.0), (-1, 0.0), (1, True), (1.0, 0.0), (1, "x"), (None, 0.0), (np.True_, 0.0), (1 << 32, 0.0), (1,)],
    ids=["i32-overflow", "negative", "bool", "float-for-int", "str", "none", "numpy-bool", "u32-overflow", "count"],
)
def test_bad_kernel_arguments_are_invalid_requests(args: tuple[object, ...]) -> None:
    kernel = xa.Kernel(name="k", source="", params=("u32", "f32"), host=print)
    if args[0] == 1 << 31:
        kernel = xa.Kernel(name="k", source="", params=("i32", "f32"), host=print)
    with pytest.raises(InvalidRequest):
        cuda_mod._pack_args(kernel, args)


# -- a tiny kernel with a host twin ---------------------------------------------------------
def _axpy_host(mem: Any, _grid: Any, _block: Any, a: float, x: int, y: int, n: int) -> None:
    xs = mem.array(x, n, np.float32)
    ys = mem.array(y, n, np.float32)
    ys[:] = np.float32(a) * xs + ys


AXPY = xa.Kernel(
    name="xlog_test_axpy",
    source=r"""
extern "C" __global__ void xlog_test_axpy(float a, const float* x, float* y, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
""",
    params=("f32", "ptr", "ptr", "u32"),
    host=_axpy_host,
)


def test_launch_tiny_kernel(driver: xa.Driver) -> None:
    """The same kernel on every driver present: small integers keep float results exact."""
    n = 1000
    x = np.arange(n, dtype=np.float32)
    y = np.full(n, 3.0, dtype=np.float32)
    stream = driver.create_stream(0)
    px = driver.alloc(0, x.nbytes)
    py = driver.alloc(0, y.nbytes)
    try:
        driver.copy_to_device(px, x, stream)
        driver.copy_to_device(py, y, stream)
        driver.launch(AXPY, (n + 255) // 256, 256, (2.0, px, py, n), stream)
        out = driver.copy_to_host(py, y.nbytes, stream)
        stream.synchronize()
        np.testing.assert_array_equal(np.frombuffer(out, np.float32), 2.0 * x + 3.0)
        with pytest.raises(InvalidRequest):
            driver.launch(AXPY, 1, 1, (2.0, px, py), stream)
    finally:
        stream.synchronize()
        driver.free(0, px)
        driver.free(0, py)
        stream.close()


# -- GPU ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cuda() -> Iterator[CudaDriver]:
    driver = CudaDriver()
    yield driver
    driver.close()


@pytest.fixture
def stream(cuda: CudaDriver) -> Iterator[CudaStream]:
    s = cuda.create_stream(0)
    yield s
    s.close()


def _pattern(nbytes: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


@pytest.mark.gpu
def test_device_queries(cuda: CudaDriver) -> None:
    assert cuda.kind == "cuda"
    assert cuda.device_count() >= 1
    assert cuda.device_name(0)
    assert cuda.compute_capability(0).startswith("sm_")
    free, total = cuda.mem_info(0)
    assert 0 < free <= total
    cuda.make_current(0)
    with pytest.raises(InvalidRequest):
        cuda.mem_info(cuda.device_count())
    with pytest.raises(InvalidRequest):
        cuda.device_name(-1)


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None, "4"])
def test_bad_sizes_are_invalid_requests(cuda: CudaDriver, stream: CudaStream, bad: object) -> None:
    with pytest.raises(InvalidRequest):
        cuda.alloc(0, bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        cuda.alloc_async(bad, stream)  # type: ignore[arg-type]


@pytest.mark.gpu
def test_bad_ordinals_are_invalid_requests(cuda: CudaDriver) -> None:
    for ordinal in (cuda.device_count(), -1, 0.0, True):
        with pytest.raises(InvalidRequest):
            cuda.alloc(ordinal, 16)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest):
            cuda.create_stream(ordinal)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("nbytes", [1, 255, 4096, MiB + 3])
def test_alloc_free_round_trip(cuda: CudaDriver, stream: CudaStream, nbytes: int) -> None:
    data = _pattern(nbytes, nbytes)
    src = bytearray(data)
    ptr = cuda.alloc(0, nbytes)
    other = cuda.alloc(0, nbytes)
    try:
        assert ptr != other
        cuda.copy_to_device(ptr, src, stream)
        src[:] = b"\0" * nbytes  # the driver snapshotted it: reuse is allowed at once
        cuda.copy_device_to_device(other, ptr, nbytes, stream)
        out = cuda.copy_to_host(other, nbytes, stream)
        into = np.zeros(nbytes, dtype=np.uint8)
        cuda.copy_to_host_into(ptr, into, stream)
        stream.synchronize()
        assert bytes(out) == data
        assert into.tobytes() == data
    finally:
        cuda.free(0, ptr)
        cuda.free(0, other)


@pytest.mark.gpu
@pytest.mark.parametrize("nbytes", [1, 255, 4096, MiB + 3])
def test_alloc_async_round_trip(cuda: CudaDriver, stream: CudaStream, nbytes: int) -> None:
    data = _pattern(nbytes, nbytes + 1)
    ptr = cuda.alloc_async(nbytes, stream)
    cuda.copy_to_device(ptr, data, stream)
    out = cuda.copy_to_host(ptr, nbytes, stream)
    cuda.free_async(ptr, stream)
    stream.synchronize()
    assert bytes(out) == data
    # The pool keeps what was freed: allocating again on the same stream is served from it.
    again = cuda.alloc_async(nbytes, stream)
    cuda.free_async(again, stream)
    stream.synchronize()


@pytest.mark.gpu
def test_fill(cuda: CudaDriver, stream: CudaStream) -> None:
    ptr = cuda.alloc_async(10_000, stream)
    cuda.fill(ptr, 0xA5, 10_000, stream)
    cuda.fill(ptr + 100, 0x00, 50, stream)
    out = cuda.copy_to_host(ptr, 10_000, stream)
    cuda.free_async(ptr, stream)
    stream.synchronize()
    expected = bytearray(b"\xa5" * 10_000)
    expected[100:150] = b"\0" * 50
    assert out == expected
    with pytest.raises(InvalidRequest):
        cuda.fill(ptr, 256, 1, stream)


@pytest.mark.gpu
def test_sleep_makes_a_stream_slow(cuda: CudaDriver, stream: CudaStream) -> None:
    cuda.sleep(stream, 1)  # compiles and loads the sleep kernel outside the timed part
    stream.synchronize()
    start = time.perf_counter()
    cuda.sleep(stream, 200_000)
    if not UNDER_SANITIZER:  # the sanitizer may run launches to completion before returning
        assert stream.query() is False
    stream.synchronize()
    assert time.perf_counter() - start >= 0.18
    assert stream.query() is True


@pytest.mark.gpu
def test_events(cuda: CudaDriver, stream: CudaStream) -> None:
    fresh = cuda.create_event(0)
    assert isinstance(fresh, CudaEvent) and fresh.ordinal == 0
    assert fresh.query() is True  # never recorded counts as complete, as in CUDA
    cuda.sleep(stream, 150_000)
    stream.record(fresh)  # a pooled event, re-recorded
    ev = stream.record_event()
    if not UNDER_SANITIZER:  # the sanitizer may run launches to completion before returning
        assert fresh.query() is False and ev.query() is False
    ev.synchronize()
    assert ev.query() is True and fresh.query() is True
    stream.record(fresh)  # recorded again at an idle point
    fresh.synchronize()
    assert fresh.query() is True


@pytest.mark.gpu
def test_wait_orders_work_across_streams(cuda: CudaDriver) -> None:
    """A slow writer on one stream, a reader on another: with ``wait`` the reader sees the
    write; without it (the negative control, which shows the test can fail) it reads the old
    bytes, because the streams really run concurrently."""
    slow = cuda.create_stream(0)
    reader = cuda.create_stream(0)
    nbytes = 1 << 16
    ptr = cuda.alloc(0, nbytes)
    try:
        cuda.fill(ptr, 0x11, nbytes, slow)
        slow.synchronize()

        cuda.sleep(slow, 300_000)
        cuda.fill(ptr, 0xAB, nbytes, slow)
        reader.wait(slow.record_event())
        ordered = cuda.copy_to_host(ptr, nbytes, reader)
        reader.synchronize()
        assert ordered == b"\xab" * nbytes

        cuda.sleep(slow, 300_000)
        cuda.fill(ptr, 0xCD, nbytes, slow)
        unordered = cuda.copy_to_host(ptr, nbytes, reader)  # no wait: a race on purpose
        reader.synchronize()
        tail = cuda.copy_to_host(ptr, 4, slow)
        slow.synchronize()
        if not UNDER_SANITIZER:  # the sanitizer may serialize the streams
            assert unordered == b"\xab" * nbytes
        assert tail == b"\xcd" * 4
    finally:
        slow.synchronize()
        cuda.free(0, ptr)
        slow.close()
        reader.close()


@pytest.mark.gpu
def test_oom_is_typed_and_the_driver_stays_usable(cuda: CudaDriver, stream: CudaStream) -> None:
    _free, total = cuda.mem_info(0)
    huge = total * 4
    with pytest.raises(OutOfMemory) as sync_oom:
        cuda.alloc(0, huge)
    assert sync_oom.value.requested == huge
    with pytest.raises(OutOfMemory) as async_oom:
        cuda.alloc_async(huge, stream)
    assert async_oom.value.requested == huge
    ptr = cuda.alloc(0, 4096)
    cuda.free(0, ptr)
    ptr = cuda.alloc_async(4096, stream)
    cuda.fill(ptr, 7, 4096, stream)
    assert cuda.copy_to_host(ptr, 4096, stream)[:4] == b"\x07" * 4
    cuda.free_async(ptr, stream)
    stream.synchronize()


@pytest.mark.gpu
def test_driver_errors_keep_the_driver_usable(cuda: CudaDriver, stream: CudaStream) -> None:
    with pytest.raises(DriverError) as bad_free:
        cuda.free(0, 0x10)
    assert bad_free.value.code is not None and bad_free.value.code.startswith("CUDA_ERROR_")
    ptr = cuda.alloc(0, 64)
    cuda.free(0, ptr)
    with pytest.raises(DriverError, match="not a live cuMemAlloc allocation") as double_free:
        cuda.free(0, ptr)  # a second free is refused before CUDA sees it
    assert double_free.value.code == "CUDA_ERROR_INVALID_VALUE"
    # memory this driver did not allocate (another library's) is refused, not freed
    from cuda.bindings import driver as cu

    err, foreign = cu.cuMemAlloc(64)
    assert int(err) == 0
    with pytest.raises(DriverError, match="not a live cuMemAlloc allocation"):
        cuda.free(0, int(foreign))
    (err,) = cu.cuMemFree(foreign)
    assert int(err) == 0, "the foreign allocation was still live"


@pytest.mark.gpu
def test_closed_stream_is_invalid(cuda: CudaDriver) -> None:
    s = cuda.create_stream(0)
    assert s.id > 0 and s.ordinal == 0 and s.handle != 0
    assert s.__cuda_stream__() == (0, s.handle)
    other = cuda.create_stream(0)
    assert other.id != s.id
    s.close()
    s.close()  # idempotent
    with pytest.raises(DriverError) as info:
        s.synchronize()
    assert info.value.code == "CUDA_ERROR_INVALID_HANDLE"
    with pytest.raises(DriverError):
        cuda.alloc_async(16, s)
    host = xa.HostDriver()
    try:
        with pytest.raises(InvalidRequest):
            cuda.fill(1, 0, 1, host.create_stream(0))  # type: ignore[arg-type]
    finally:
        host.close()
    other.close()


@pytest.mark.gpu
def test_host_buffers_outlive_their_copies(cuda: CudaDriver, stream: CudaStream) -> None:
    """Copies queued behind a sleep: the driver, not the caller, keeps the buffers alive."""
    nbytes = 4 * MiB
    ptr = cuda.alloc_async(nbytes, stream)
    cuda.sleep(stream, 100_000)
    cuda.copy_to_device(ptr, bytearray(_pattern(nbytes, 7)), stream)
    out = np.empty(nbytes, dtype=np.uint8)
    cuda.sleep(stream, 50_000)
    cuda.copy_to_host_into(ptr, out, stream)
    gc.collect()
    stream.synchronize()
    assert out.tobytes() == _pattern(nbytes, 7)
    assert not stream._keep  # pruned at the synchronize
    cuda.free_async(ptr, stream)
    stream.synchronize()


@pytest.mark.gpu
def test_a_closed_stream_lets_the_buffers_of_its_finished_copies_go_at_once(cuda: CudaDriver) -> None:
    """The host buffer of a copy that ran is dropped when its stream closes, not by whichever copy
    comes next on the device (which paid for freeing pinned memory in the middle of its work)."""

    class Source(bytearray):
        pass  # a bytearray that a weak reference can follow

    stream = cuda.create_stream(0)
    ptr = cuda.alloc_async(4096, stream)
    source = Source(4096)
    alive = weakref.ref(source)
    cuda.sleep(stream, 20_000)  # so the copy has not run when the stream first prunes its list
    cuda.copy_to_device(ptr, source, stream)
    stream.record_event().synchronize()  # ran, but nothing pruned the stream's list since
    del source
    assert alive() is not None  # the stream still holds it
    cuda.free_async(ptr, stream)
    stream.close()
    assert alive() is None, "a finished copy's buffer outlived its closed stream"


@pytest.mark.gpu
def test_many_threads(cuda: CudaDriver) -> None:
    """Every thread gets the context made current by the driver itself."""
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            s = cuda.create_stream(0)
            for i in range(20):
                nbytes = 1024 + 17 * i + seed
                data = _pattern(nbytes, seed * 100 + i)
                ptr = cuda.alloc_async(nbytes, s) if i % 2 else cuda.alloc(0, nbytes)
                cuda.copy_to_device(ptr, data, s)
                out = cuda.copy_to_host(ptr, nbytes, s)
                s.synchronize()
                assert bytes(out) == data
                if i % 2:
                    cuda.free_async(ptr, s)
                else:
                    cuda.free(0, ptr)
            s.synchronize()
            s.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.gpu
def test_garbage_collected_streams_and_events_are_destroyed(cuda: CudaDriver) -> None:
    for _ in range(50):
        s = cuda.create_stream(0)
        s.record_event()
        del s
    gc.collect()
    kept = cuda.create_event(0)  # buries what the finalizers left
    assert not cuda._devices[0].graveyard
    assert kept.query() is True


def _run_child(script: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=str(REPO),
    )


@pytest.mark.gpu
def test_rebuild_context_in_a_subprocess() -> None:
    """Old streams and events become invalid, memory returns to its baseline, and pools, modules
    and the sleep kernel work again. In a child, so that the gigabytes it holds cannot stay
    taken for the rest of the run if it fails midway."""
    proc = _run_child(
        """
        import numpy as np
        import xlog_actors as xa
        from xlog_actors.driver.cuda import CudaDriver
        from xlog_actors.errors import DriverError

        AXPY = xa.Kernel(name="xlog_test_axpy", source=AXPY_SOURCE, params=("f32", "ptr", "ptr", "u32"),
                         host=print)

        drv = CudaDriver()
        free0, total = drv.mem_info(0)
        s = drv.create_stream(0)
        p = drv.alloc(0, 1 << 30)
        q = drv.alloc_async(1 << 30, s)
        drv.fill(p, 1, 1 << 30, s)
        drv.fill(q, 2, 1 << 30, s)
        drv.launch(AXPY, 1, 32, (1.0, q, q, 32), s)
        drv.sleep(s, 10)
        ev = s.record_event()
        s.synchronize()
        free1, _ = drv.mem_info(0)
        # At least one GiB shows as taken (a driver may map cuMemAlloc memory lazily). Under
        # compute-sanitizer the tool's own allocations move cuMemGetInfo: the plain run checks.
        import os
        if os.environ.get("XLOG_ACTORS_SANITIZER") != "1":
            assert free1 <= free0 - (1 << 30), (free0, free1)

        drv.rebuild_context(0)
        for what, call in (("stream", s.synchronize), ("event", ev.query),
                           ("alloc_async", lambda: drv.alloc_async(16, s))):
            try:
                call()
            except DriverError as exc:
                assert exc.code == "CUDA_ERROR_INVALID_HANDLE", (what, exc.code)
            else:
                raise AssertionError(what + " still usable after the rebuild")
        free2, _ = drv.mem_info(0)
        if os.environ.get("XLOG_ACTORS_SANITIZER") != "1":
            assert free2 >= free0 - (128 << 20), (free0, free2)

        s2 = drv.create_stream(0)
        x = np.arange(64, dtype=np.float32)
        px = drv.alloc_async(x.nbytes, s2)
        drv.copy_to_device(px, x, s2)
        drv.launch(AXPY, 1, 64, (1.0, px, px, 64), s2)
        drv.sleep(s2, 1000)
        out = np.frombuffer(drv.copy_to_host(px, x.nbytes, s2), np.float32)
        s2.synchronize()
        assert (out == 2 * x).all(), out
        drv.free_async(px, s2)
        s2.synchronize()
        drv.rebuild_context(0)  # a second rebuild works as well
        drv.close()
        drv.close()
        print("REBUILD-OK", free0, free1, free2)
        """.replace("AXPY_SOURCE", repr(AXPY.source))
    )
    assert proc.returncode == 0 and "REBUILD-OK" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.gpu
def test_the_liveness_token_the_compiled_core_checks_follows_close_and_rebuild() -> None:
    """``_live is device.epoch_token`` exactly while a stream or event may be used on the
    compiled fast path: it stops holding at close, at collection (by ``_invalidate``'s path too)
    and for every object of an older epoch after a rebuild. In a child, since it rebuilds."""
    proc = _run_child(
        """
        from xlog_actors.driver.cuda import CudaDriver

        drv = CudaDriver()
        dev = drv._device(0)
        s, closed = drv.create_stream(0), drv.create_stream(0)
        ev = drv.create_event(0)
        rec = s.record_event()
        assert s._live is dev.epoch_token and ev._live is dev.epoch_token and rec._live is dev.epoch_token
        closed.close()
        assert closed._live is None and closed._closed == "closed"
        old = dev.epoch_token
        drv.rebuild_context(0)
        assert dev.epoch_token is not old
        assert s._live is None and s._closed is not None, "a rebuild retires the stream"
        assert ev._live is not dev.epoch_token and rec._live is not dev.epoch_token
        s2, ev2 = drv.create_stream(0), drv.create_event(0)
        assert s2._live is dev.epoch_token and ev2._live is dev.epoch_token
        s2.close()
        drv.close()
        print("LIVE-OK")
        """
    )
    assert proc.returncode == 0 and "LIVE-OK" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.gpu
def test_a_rebuild_leaves_the_other_users_of_the_primary_context_alone() -> None:
    """Another library's allocation, stream and module in the same primary context (what
    PyTorch or CuPy hold there) go on working across our rebuild, while everything of ours is
    freed: memory back to its baseline, our events destroyed when collected. In a child, so
    the foreign objects cannot outlive the test."""
    proc = _run_child(
        """
        import gc, os
        import numpy as np
        from cuda.bindings import driver as cu
        from xlog_actors.driver.cuda import CudaDriver

        def ok(result):
            err, *rest = result if isinstance(result, tuple) else (result,)
            assert int(err) == 0, err
            return rest[0] if len(rest) == 1 else rest

        drv = CudaDriver()
        s = drv.create_stream(0)  # retains the primary context
        ok(cu.cuInit(0))
        dev = ok(cu.cuDeviceGet(0))
        ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))  # the foreign library
        ok(cu.cuCtxSetCurrent(ctx))
        fptr = ok(cu.cuMemAlloc(4096))
        fstream = ok(cu.cuStreamCreate(1))
        ok(cu.cuMemsetD8Async(fptr, 7, 4096, fstream))
        ok(cu.cuStreamSynchronize(fstream))
        free0, _ = drv.mem_info(0)

        ours = [drv.alloc(0, 256 << 20), drv.alloc_async(256 << 20, s)]
        events = [s.record_event() for _ in range(100)]
        s.synchronize()
        drv.rebuild_context(0)
        del events
        gc.collect()
        graveyard = len(drv._devices[0].graveyard)
        kept = drv.create_event(0)  # buries the collected events of the old epoch
        assert graveyard == 100 and not drv._devices[0].graveyard, graveyard
        free1, _ = drv.mem_info(0)
        if os.environ.get("XLOG_ACTORS_SANITIZER") != "1":  # the tool's own allocations move it
            assert free1 >= free0 - (64 << 20), (free0, free1)

        ok(cu.cuCtxSetCurrent(ctx))
        buf = np.zeros(4096, np.uint8)
        ok(cu.cuMemcpyDtoH(buf.ctypes.data, fptr, 4096))
        assert (buf == 7).all()
        ok(cu.cuMemsetD8Async(fptr, 9, 4096, fstream))
        ok(cu.cuStreamSynchronize(fstream))
        ok(cu.cuMemcpyDtoH(buf.ctypes.data, fptr, 4096))
        assert (buf == 9).all()
        state = ok(cu.cuDevicePrimaryCtxGetState(dev))
        assert state[1] == 1, state  # still active: never reset

        s2 = drv.create_stream(0)
        p = drv.alloc_async(4096, s2)
        drv.fill(p, 3, 4096, s2)
        assert bytes(drv.copy_to_host(p, 4, s2)) == b"\\x03" * 4
        drv.free_async(p, s2)
        del kept
        drv.close()
        ok(cu.cuCtxSetCurrent(ctx))  # our close leaves the foreign objects alone too
        ok(cu.cuMemcpyDtoH(buf.ctypes.data, fptr, 4096))
        assert (buf == 9).all()
        ok(cu.cuStreamDestroy(fstream))
        ok(cu.cuMemFree(fptr))
        ok(cu.cuDevicePrimaryCtxRelease(dev))
        print("COTENANT-OK", free0, free1)
        """
    )
    assert proc.returncode == 0 and "COTENANT-OK" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(UNDER_SANITIZER, reason="plants a real illegal address: the sanitizer reports it")
def test_real_sticky_error_poisons_in_a_subprocess() -> None:
    """A kernel writing to an unmapped address: ContextPoisoned at the synchronize, and from
    then on (rebuild_context included), as CUDA cannot recover in-process."""
    proc = _run_child(
        """
        import xlog_actors as xa
        from xlog_actors.driver.cuda import CudaDriver
        from xlog_actors.driver.cuda import STICKY_CODES

        poke = xa.Kernel(name="xlog_poke", params=("ptr",), host=print,
                         source='extern "C" __global__ void xlog_poke(int* p) { *p = 1; }')
        drv = CudaDriver()
        s = drv.create_stream(0)
        drv.launch(poke, 1, 1, (0x10,), s)
        try:
            s.synchronize()
        except xa.ContextPoisoned as exc:
            assert exc.code in STICKY_CODES, exc.code
            code = exc.code
        else:
            raise AssertionError("no sticky error surfaced")
        for call in (lambda: drv.alloc(0, 16), lambda: drv.rebuild_context(0),
                     lambda: drv.create_stream(0), s.query):
            try:
                call()
            except xa.ContextPoisoned:
                pass
            else:
                raise AssertionError("a poisoned device still answered")
        drv.close()
        print("POISONED", code)
        """
    )
    assert proc.returncode == 0 and "POISONED CUDA_ERROR_" in proc.stdout, proc.stdout + proc.stderr


# -- the GIL-keeping calls ---------------------------------------------------------------------
def test_is_pinned_answers_only_for_ranges_inside_one_live_pinned_allocation() -> None:
    """The driver keeps the GIL across a host copy only when its memory is page-locked: the
    check must refuse any range that leaves the allocation (a pageable copy may block)."""
    from xlog_actors.driver.cuda.host_memory import CudaHostMemory

    mem = CudaHostMemory.__new__(CudaHostMemory)
    mem._pinned_table().update({0x10000: (0, 4096), 0x40000: (0, 256)})
    assert mem._is_pinned(0x10000, 4096) and mem._is_pinned(0x10800, 16) and mem._is_pinned(0x40000, 256)
    for address, nbytes in ((0x10000, 4097), (0xFFFF, 2), (0x10FFF, 2), (0x20000, 1), (0x40001, 256)):
        assert not mem._is_pinned(address, nbytes), (hex(address), nbytes)
    # An address met before is answered from its hit, still against the live table: a longer
    # range past the allocation, or the allocation freed (and another made elsewhere), is refused.
    assert mem._is_pinned(0x10800, 16) and mem._is_pinned(0x10800, 16)
    assert not mem._is_pinned(0x10800, 4096)
    del mem._pinned_table()[0x10000]
    mem._pinned_table()[0x80000] = (0, 4096)
    assert not mem._is_pinned(0x10800, 16)
    mem._pinned_table()[0x10000] = (0, 256)  # a smaller allocation at the same base
    assert not mem._is_pinned(0x10800, 16) and mem._is_pinned(0x10010, 16)


@pytest.mark.gpu
def test_host_copies_through_the_gil_keeping_calls_move_the_right_bytes(cuda: CudaDriver, stream: CudaStream) -> None:
    """Pinned host memory goes through ``HeldCalls`` (pageable through cuda.bindings): both
    directions, a device-to-device copy, an event recorded and queried, all on the real driver."""
    n = 1 << 20
    src_p, dst_p = cuda.alloc_pinned(0, n), cuda.alloc_pinned(0, n)
    try:
        src = np.frombuffer(cuda.pinned_view(src_p, n), np.uint8)
        dst = np.frombuffer(cuda.pinned_view(dst_p, n), np.uint8)
        src[:] = np.frombuffer(_pattern(n, 3), np.uint8)
        assert cuda._is_pinned(src.ctypes.data, n) and not cuda._is_pinned(np.zeros(n, np.uint8).ctypes.data, n)
        a, b = cuda.alloc_async(n, stream), cuda.alloc_async(n, stream)
        cuda.copy_to_device(a, src, stream)
        cuda.copy_device_to_device(b, a, n, stream)
        cuda.copy_to_host_into(b, dst, stream)
        event = stream.record_event()
        stream.synchronize()
        assert event.query() is True
        assert bytes(dst) == bytes(src)
        pageable = np.zeros(n, np.uint8)
        cuda.copy_to_host_into(a, pageable, stream)
        stream.synchronize()
        assert bytes(pageable) == bytes(src)
        cuda.free_async(a, stream)
        cuda.free_async(b, stream)
        stream.synchronize()
    finally:
        gc.collect()
        cuda.free_pinned(0, src_p)
        cuda.free_pinned(0, dst_p)
