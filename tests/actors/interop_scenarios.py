"""PyTorch and CuPy consuming a ``GpuRef``, each scenario run in a fresh process by
``test_interop.py`` (``python interop_scenarios.py NAME [ARGS...]``; exit code 0 means it held).

Why a process each: PyTorch and CuPy keep their own objects (caching allocators, loaded modules,
cuBLAS handles) in the device's primary context for the life of the process. When ``Rebuild``
still reset that context, sharing the test process with the rebuild tests left them with
dangling handles and the interpreter crashed at exit on the H200; a fresh process per scenario
keeps any such fault inside the scenario that causes it, where its exit code reports it. A
scenario ends by stopping its actors and closing its driver.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pykka

import xlog_actors as xa
from xlog_actors.actors import interop

SLOW_US = 200_000
#: GPU clock cycles of ``torch.cuda._sleep``: about 200 ms at an H200's 1.98 GHz. It only has
#: to outlast a CopyActor round trip.
SLOW_CYCLES = 400_000_000
N = 1 << 20


def _start() -> tuple[xa.CudaDriver, pykka.ActorRef[Any], pykka.ActorRef[Any]]:
    driver = xa.CudaDriver()
    device = xa.DeviceActor.start(0, driver)
    return driver, device, xa.CopyActor.start(device)


def _slow_fill(ref: xa.GpuRef, copy: pykka.ActorRef[Any], value: int) -> None:
    """Zero ``ref`` and wait for it, then queue a fill of ``value`` behind a slow kernel on the
    copy actor's stream: a consumer that does not wait for that stream reads zeros."""
    copy.ask(xa.Fill(ref, 0))
    copy.ask(xa.CopyToHost(ref, nbytes=1))  # the zero fill has landed
    ctx = ref.context
    stream = ctx.runtime.stream_pool.resolve(copy.proxy().stream_id.get())
    ctx.driver.sleep(stream, SLOW_US)
    copy.ask(xa.Fill(ref, value))


def _warm_up(device: pykka.ActorRef[Any], copy: pykka.ActorRef[Any], consume: Callable[[xa.GpuRef], int]) -> None:
    """Run the consumer's own path once on a scratch handle: its first use initializes the
    library and loads (or compiles) its kernels, which takes longer than the slow kernel the
    race below relies on."""
    scratch = device.ask(xa.Allocate(N))
    copy.ask(xa.Fill(scratch, 1))
    copy.ask(xa.CopyToHost(scratch, nbytes=1))
    assert consume(scratch) == N
    scratch.release()


def _untrack() -> None:
    """What a producer that ignores the protocols' stream rules would do: no ``stream`` in the
    CUDA Array Interface and no ordering of the DLPack consumer's stream."""
    interop.stream_handle = lambda ctx, sid: None
    xa.CudaDriver.order_foreign_stream = lambda self, handle, after: None  # type: ignore[method-assign]


def torch_reads_without_a_copy() -> None:
    import torch

    driver, device, copy = _start()
    try:
        ref = device.ask(xa.Allocate(N))
        copy.ask(xa.CopyToDevice(ref, np.full(N, 5, np.uint8)))
        tensor = torch.from_dlpack(ref)
        assert tensor.data_ptr() == ref.raw_device_ptr()
        assert tensor.device == torch.device("cuda", 0)
        assert tensor.dtype == torch.uint8 and tensor.shape == (N,)
        assert int(tensor.sum(dtype=torch.int64).item()) == 5 * N
        tensor[:16] = 9  # a view, not a copy: torch's write is seen through the handle
        torch.cuda.synchronize()
        assert copy.ask(xa.CopyToHost(ref, nbytes=17)) == bytes([9] * 16 + [5])
        del tensor
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()


def cupy_reads_without_a_copy() -> None:
    import cupy as cp

    driver, device, copy = _start()
    try:
        ref = device.ask(xa.Allocate(N))
        copy.ask(xa.Fill(ref, 3))
        for view in (cp.asarray(ref), cp.from_dlpack(ref)):
            assert view.data.ptr == ref.raw_device_ptr()
            assert view.dtype == cp.uint8 and view.shape == (N,)
            assert int(view.sum(dtype=cp.int64)) == 3 * N
        del view
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()


def torch_waits_for_the_last_write(tracked: str) -> None:
    import torch

    driver, device, copy = _start()
    try:
        def consume(r: xa.GpuRef) -> int:
            return int(torch.from_dlpack(r).sum(dtype=torch.int64).item())

        _warm_up(device, copy, consume)
        ref = device.ask(xa.Allocate(N))
        if tracked != "tracked":
            _untrack()
        _slow_fill(ref, copy, 5)
        total = consume(ref)
        if tracked == "tracked":
            assert total == 5 * N, total
        else:
            assert total != 5 * N, "without ordering torch read before the slow write landed"
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()


def cupy_waits_for_the_last_write(tracked: str, protocol: str) -> None:
    import cupy as cp

    driver, device, copy = _start()
    try:
        def consume(r: xa.GpuRef) -> int:
            view = cp.asarray(r) if protocol == "cuda_array_interface" else cp.from_dlpack(r)
            return int(view.sum(dtype=cp.int64))

        _warm_up(device, copy, consume)
        ref = device.ask(xa.Allocate(N))
        if tracked != "tracked":
            _untrack()
        _slow_fill(ref, copy, 5)
        total = consume(ref)
        if tracked == "tracked":
            assert total == 5 * N, total
        else:
            assert total != 5 * N, "without ordering CuPy read before the slow write landed"
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()


def torch_keeps_the_memory_alive() -> None:
    """The tensor holds the GpuRef: with every other reference dropped, nothing is freed while
    torch can still read it, and the memory goes back once the tensor goes."""
    import gc

    import torch

    driver, device, copy = _start()
    try:
        ref = device.ask(xa.Allocate(N))
        copy.ask(xa.Fill(ref, 4))
        tensor = torch.from_dlpack(ref)
        del ref
        gc.collect()
        device.ask(xa.GetStats())  # drains dropped handles: a freed ref would go back here
        other = device.ask(xa.Allocate(N))
        copy.ask(xa.Fill(other, 7))
        copy.ask(xa.CopyToHost(other, nbytes=1))
        assert other.raw_device_ptr() != tensor.data_ptr()
        assert device.ask(xa.GetStats()).bytes_outstanding == 2 * N
        assert int(tensor.sum(dtype=torch.int64).item()) == 4 * N
        del tensor
        gc.collect()
        for _ in range(500):  # the free is stream-ordered: reaped once it completed
            if device.ask(xa.GetStats()).bytes_outstanding == N:
                break
            time.sleep(0.01)
        assert device.ask(xa.GetStats()).bytes_outstanding == N
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()


def torch_lives_through_a_rebuild() -> None:
    """PyTorch's own tensors, its caching allocator and cuBLAS keep working across a Rebuild of
    the device actor: the rebuild frees only what xlog_actors made."""
    import torch

    driver, device, copy = _start()
    try:
        own = torch.arange(N, device="cuda", dtype=torch.float32)
        m = torch.randn(256, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        before = (m @ m).sum().item()
        old = device.ask(xa.Allocate(N))
        copy.ask(xa.Fill(old, 1))
        assert int(torch.from_dlpack(old).sum(dtype=torch.int64).item()) == N
        assert device.ask(xa.Rebuild("test")) == 1
        try:
            old.access()
        except xa.GpuRefStale as exc:
            assert exc.reason == "context rebuilt"
        else:
            raise AssertionError("a handle of the old generation is still usable")
        assert torch.equal(own, torch.arange(N, device="cuda", dtype=torch.float32))
        assert (m @ m).sum().item() == before  # same cuBLAS handle, same kernels, same result
        more = torch.ones(N, device="cuda")  # the caching allocator still works
        fresh = device.ask(xa.Allocate(N))
        copy.ask(xa.Fill(fresh, 2))
        assert int(torch.from_dlpack(fresh).sum(dtype=torch.int64).item()) == 2 * N
        assert int(more.sum().item()) == N
        torch.cuda.synchronize()
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()
    assert torch.equal(own, torch.arange(N, device="cuda", dtype=torch.float32))  # and after close


def cupy_lives_through_a_rebuild() -> None:
    import cupy as cp

    driver, device, copy = _start()
    try:
        own = cp.arange(N, dtype=cp.int64)
        total = int(own.sum())  # loads CuPy's reduction kernel into the context
        old = device.ask(xa.Allocate(N))
        copy.ask(xa.Fill(old, 1))
        assert int(cp.asarray(old).sum(dtype=cp.int64)) == N
        device.ask(xa.Rebuild("test"))
        assert int(own.sum()) == total  # the same module, still loaded
        fresh = device.ask(xa.Allocate(N))
        copy.ask(xa.Fill(fresh, 2))
        assert int(cp.from_dlpack(fresh).sum(dtype=cp.int64)) == 2 * N
        cp.cuda.Device(0).synchronize()
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()
    assert int(own.sum()) == total


def actors_wait_for_a_torch_write(tracked: str, which: str) -> None:
    """PyTorch writes the memory behind a slow kernel on its own stream (a side stream, or its
    default stream, handle 0); a CopyActor then reads it on another stream at once. Correct when
    the write was declared with ``record_foreign_write``, stale when it was not."""
    import torch

    driver, device, copy = _start()
    try:
        ref = device.ask(xa.Allocate(N))
        copy.ask(xa.Fill(ref, 0))
        copy.ask(xa.CopyToHost(ref, nbytes=1))  # the zero fill has landed
        tensor = torch.from_dlpack(ref)
        stream = torch.cuda.Stream() if which == "side" else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(1000)  # warm-up: load torch's kernels before the race
            tensor.fill_(1)
        stream.synchronize()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLOW_CYCLES)
            tensor.fill_(6)
        if tracked == "tracked":
            ref.record_foreign_write(stream)
        got = copy.ask(xa.CopyToHost(ref))
        torch.cuda.synchronize()
        if tracked == "tracked":
            assert got == bytes([6]) * N, sorted(set(got))
            assert ref.last_write_stream == xa.StreamId.DEFAULT
        else:
            assert got != bytes([6]) * N, "without the declaration the copy read before torch's write"
        del tensor
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()


SCENARIOS: dict[str, Callable[..., None]] = {
    f.__name__: f
    for f in (
        torch_reads_without_a_copy,
        cupy_reads_without_a_copy,
        torch_waits_for_the_last_write,
        cupy_waits_for_the_last_write,
        torch_keeps_the_memory_alive,
        torch_lives_through_a_rebuild,
        cupy_lives_through_a_rebuild,
        actors_wait_for_a_torch_write,
    )
}


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    SCENARIOS[name](*args)
    print(f"{name}{tuple(args)}: held")
