"""The CUDA driver's pinned-memory bookkeeping, run anywhere: the driver calls go to a fake
``cuda.bindings.driver`` that records them, so the table, the refusals, the context push and pop
around each free, and the leftovers freed at close are checked without a GPU. (The real calls are
exercised by the ``gpu``-marked driver tests.)"""

from __future__ import annotations

import ctypes
from typing import Any, NoReturn, cast

import pytest

import xlog_actors as xa
from xlog_actors.driver.cuda import host_memory
from xlog_actors.driver.cuda.call import SUCCESS, cu, error_for
from xlog_actors.driver.cuda.context import CudaDevice
from xlog_actors.driver.cuda.host_memory import CudaHostMemory

pytestmark = pytest.mark.skipif(cu is None, reason="cuda-python is not importable")


class _FakeCu:
    """Page-locked memory as ctypes buffers; every call logged as (name, args)."""

    CU_MEMHOSTALLOC_PORTABLE = 1

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.buffers: dict[int, ctypes.Array[ctypes.c_ubyte]] = {}
        self.refuse_alloc: Any = None
        self.stack: list[object] = []

    def cuMemHostAlloc(self, nbytes: int, flags: int) -> tuple[Any, int]:
        self.calls.append(("alloc", (nbytes, flags)))
        if self.refuse_alloc is not None:
            return self.refuse_alloc, 0
        buf = (ctypes.c_ubyte * nbytes)()
        self.buffers[ctypes.addressof(buf)] = buf
        return SUCCESS, ctypes.addressof(buf)

    def cuMemFreeHost(self, ptr: int) -> tuple[Any]:
        self.calls.append(("free", (ptr, list(self.stack))))
        del self.buffers[ptr]
        return (SUCCESS,)

    def cuCtxPushCurrent(self, ctx: object) -> tuple[Any]:
        self.stack.append(ctx)
        return (SUCCESS,)

    def cuCtxPopCurrent(self) -> tuple[Any, object]:
        return SUCCESS, self.stack.pop()

    def cuCtxSynchronize(self) -> tuple[Any]:
        self.calls.append(("sync", (list(self.stack),)))
        return (SUCCESS,)


class _FakeDevice:
    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal
        self.ctx: object | None = f"ctx{ordinal}"

    def enter(self) -> None:
        pass

    def fail(self, err: object, what: str, requested: int = 0) -> NoReturn:
        raise error_for(err, f"device {self.ordinal}: {what}", requested=requested)


class _Driver(CudaHostMemory):
    def __init__(self) -> None:
        self._devices = cast("list[CudaDevice]", [_FakeDevice(0), _FakeDevice(1)])
        self._closed = False


def _real_cu() -> Any:
    return cu


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> _FakeCu:
    fake_cu = _FakeCu()
    monkeypatch.setattr(host_memory, "cu", fake_cu)
    return fake_cu


def test_the_fake_matches_the_bindings() -> None:
    real = _real_cu()
    assert real.CU_MEMHOSTALLOC_PORTABLE == _FakeCu.CU_MEMHOSTALLOC_PORTABLE
    for name in ("cuMemHostAlloc", "cuMemFreeHost", "cuCtxPushCurrent", "cuCtxPopCurrent", "cuCtxSynchronize"):
        assert callable(getattr(real, name))


def test_alloc_view_and_free_push_the_context_for_the_free(fake: _FakeCu) -> None:
    driver = _Driver()
    ptr = driver.alloc_pinned(1, 100)
    assert fake.calls == [("alloc", (100, 1))]
    view = driver.pinned_view(ptr, 100)
    view[:3] = b"abc"
    assert bytes(fake.buffers[ptr][:3]) == b"abc"
    driver.free_pinned(1, ptr)
    assert fake.calls[-1] == ("free", (ptr, ["ctx1"])) and fake.stack == []
    with pytest.raises(xa.DriverError, match="not a live cuMemHostAlloc"):
        driver.free_pinned(1, ptr)
    with pytest.raises(xa.DriverError, match="not a live pinned allocation"):
        driver.pinned_view(ptr, 1)


def test_refusals_change_nothing(fake: _FakeCu) -> None:
    driver = _Driver()
    ptr = driver.alloc_pinned(0, 64)
    for bad in (0, -1, 2.0):
        with pytest.raises(xa.InvalidRequest):
            driver.alloc_pinned(0, bad)  # type: ignore[arg-type]
    with pytest.raises(xa.DriverError, match="device 0's"):
        driver.free_pinned(1, ptr)
    with pytest.raises(xa.DriverError, match="not a live"):
        driver.free_pinned(0, ptr + 1)
    with pytest.raises(xa.DriverError, match="holds 64 bytes"):
        driver.pinned_view(ptr, 65)
    assert [c[0] for c in fake.calls] == ["alloc"]
    driver.free_pinned(0, ptr)
    assert fake.buffers == {}


def test_a_refused_alloc_is_out_of_memory(fake: _FakeCu) -> None:
    driver = _Driver()
    for code in ("CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_INVALID_VALUE"):
        fake.refuse_alloc = getattr(_real_cu().CUresult, code)
        with pytest.raises(xa.OutOfMemory) as info:
            driver.alloc_pinned(0, 1 << 40)
        assert info.value.requested == 1 << 40
    assert driver._pinned_table() == {}


def test_close_synchronizes_then_frees_the_leftovers(fake: _FakeCu) -> None:
    driver = _Driver()
    a, b = driver.alloc_pinned(0, 16), driver.alloc_pinned(1, 16)
    driver._devices[1].ctx = None  # a context gone: its memory went with it
    driver.free_pinned_leftovers()
    assert [name for name, _ in fake.calls] == ["alloc", "alloc", "sync", "free"]
    assert fake.calls[-1] == ("free", (a, ["ctx0"]))
    assert driver._pinned_table() == {} and b in fake.buffers and fake.stack == []


def test_a_free_after_the_context_went_only_forgets(fake: _FakeCu) -> None:
    driver = _Driver()
    ptr = driver.alloc_pinned(0, 16)
    driver._devices[0].ctx = None
    driver.free_pinned(0, ptr)
    assert [name for name, _ in fake.calls] == ["alloc"] and driver._pinned_table() == {}
