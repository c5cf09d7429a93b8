"""PyTorch and CuPy allocating through a device, each scenario in a fresh process run by
``test_routes_on_gpu.py`` (``python alloc_scenarios.py NAME [ARGS...]``; exit code 0 and
"held" on stdout mean it held). A process each because torch takes a pluggable allocator only
before its first CUDA allocation, for the life of the process.
"""

from __future__ import annotations

import gc
import logging
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pykka

import xlog_actors as xa

MIB = 1 << 20


def _tag_bytes(device: pykka.ActorRef[Any], tag: str) -> int:
    return int(device.ask(xa.GetStats()).report["by_tag"].get(tag, {}).get("nbytes", 0))


def _model_run(torch: Any) -> dict[str, np.ndarray]:
    """A small MLP's forward and backward, deterministic: its loss and gradients on the host."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(19)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    ).cuda()
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(7)).cuda()
    y = torch.randint(0, 10, (512,), generator=torch.Generator().manual_seed(8)).cuda()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    out = {"loss": loss.detach().cpu().numpy()}
    for name, p in model.named_parameters():
        out[name] = p.grad.detach().cpu().numpy()
    return out


def torch_model(half: str, path: str) -> None:
    """The model's loss and gradients, saved to ``path``: through the device (``half`` =
    ``device``; the tag's bytes are checked on the way) or on torch's own allocator."""
    import torch

    if half == "torch":
        np.savez(path, **_model_run(torch))
        return
    from xlog_actors.interop.torch import use_device

    driver = xa.CudaDriver()
    device = xa.DeviceActor.start(0, driver)
    try:
        route = use_device(device)
        keep = torch.ones(MIB, device="cuda")  # alive during the check below
        result = _model_run(torch)
        torch.cuda.synchronize()
        assert _tag_bytes(device, "torch") >= 4 * MIB, device.ask(xa.GetStats()).report
        assert route.allocator.ref(keep.data_ptr()).tag == "torch"
        del keep
        gc.collect()
        # cuBLAS keeps its workspaces (allocated through the device too) until told to let go.
        torch._C._cuda_clearCublasWorkspaces()
        route.allocator.flush()
        torch.cuda.synchronize()
        assert _tag_bytes(device, "torch") == 0, device.ask(xa.GetStats()).report
        assert route.allocator.live_blocks == 0
        np.savez(path, **result)
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()


def torch_budget_refusal() -> None:
    """A budget below the need: torch raises (RuntimeError, or its OutOfMemoryError, a subclass)
    with our message; the error object stays reachable; nothing leaks; torch goes on."""
    import torch

    from xlog_actors.interop.torch import use_device

    driver = xa.CudaDriver()
    device = xa.DeviceActor.start(0, driver, resource="async+budget:64MiB")
    try:
        route = use_device(device)
        small = torch.zeros(MIB, dtype=torch.uint8, device="cuda")
        try:
            torch.empty(128 * MIB, dtype=torch.uint8, device="cuda")
        except RuntimeError as exc:
            message = str(exc)
        else:
            raise AssertionError("a 128 MiB tensor under a 64 MiB budget was not refused")
        assert "BudgetExceeded" in message and "budget of 64.0 MiB" in message, message
        assert isinstance(route.last_error(), xa.BudgetExceeded)
        assert _tag_bytes(device, "torch") == MIB
        small += 1
        assert int(small.sum().item()) == MIB  # torch goes on after the refusal
        del small
        gc.collect()
        route.allocator.flush()
        assert _tag_bytes(device, "torch") == 0
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()


def torch_rebuild() -> None:
    """What a rebuild does to live tensors today (docs/user-guide.md): their blocks are freed
    with the old context; the allocator reports them at its next allocation and ignores their
    frees; new tensors work. The old tensors are not touched (their memory is gone)."""
    import torch

    from xlog_actors.interop.torch import use_device

    driver = xa.CudaDriver()
    device = xa.DeviceActor.start(0, driver)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("xlog_actors.interop").addHandler(handler)
    try:
        route = use_device(device)
        old = [torch.ones(MIB, device="cuda") for _ in range(3)]
        torch.cuda.synchronize()
        device.ask(xa.Rebuild("scenario"))
        fresh = torch.full((MIB,), 2.0, device="cuda")
        assert any("a rebuild freed 3 torch block(s)" in r.getMessage() for r in records), records
        assert len(route.allocator.lost_blocks) == 3
        del old
        gc.collect()
        assert float(fresh.sum().item()) == 2.0 * MIB
        route.allocator.flush()  # after the sum: its temporary is cached, and the flush gives it back
        assert _tag_bytes(device, "torch") == 4 * MIB
        del fresh
        gc.collect()
        route.allocator.flush()
        assert _tag_bytes(device, "torch") == 0 and route.allocator.lost_blocks == {}
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()


def torch_cache() -> None:
    """The bridge's cache under torch: a tensor freed and asked again on its stream comes back
    from the cache (same address, no new block); another stream gets its own block; results are
    right; empty_cache gives the cached bytes back; a rebuild drops the cache without counting
    its blocks as lost, and the tag returns to zero."""
    import torch

    from xlog_actors.interop.torch import use_device

    driver = xa.CudaDriver()
    device = xa.DeviceActor.start(0, driver)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("xlog_actors.interop").addHandler(handler)
    try:
        route = use_device(device)
        a = torch.full((MIB,), 3.0, device="cuda")
        address = a.data_ptr()
        del a
        b = torch.full((MIB,), 5.0, device="cuda")
        assert b.data_ptr() == address and route.cache_stats()["hits"] >= 1, route.cache_stats()
        assert float(b.sum().item()) == 5.0 * MIB
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            c = torch.full((MIB,), 7.0, device="cuda")
            del b
            d = torch.full((MIB,), 9.0, device="cuda")  # b's block is the default stream's: not reused here
        side.synchronize()
        assert d.data_ptr() not in (address, c.data_ptr()) and float(d.sum().item()) == 9.0 * MIB
        del c, d
        torch.cuda.synchronize()
        assert route.cache_stats()["cached_blocks"] >= 3
        assert route.empty_cache() >= 12 * MIB
        assert _tag_bytes(device, "torch") == 0, device.ask(xa.GetStats()).report
        e = torch.ones(MIB, device="cuda")
        del e
        torch.cuda.synchronize()
        device.ask(xa.Rebuild("scenario"))
        assert route.cache_stats()["cached_blocks"] == 0 and route.allocator.lost_blocks == {}
        assert not any("a rebuild freed" in r.getMessage() for r in records), records
        f = torch.full((MIB,), 2.0, device="cuda")
        assert float(f.sum().item()) == 2.0 * MIB
        del f
        gc.collect()
        route.allocator.flush()
        assert _tag_bytes(device, "torch") == 0 and route.allocator.live_blocks == 0
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()


def _cached_bytes(device: pykka.ActorRef[Any], tag: str) -> int:
    return int(device.ask(xa.GetStats()).report["cached"]["by_tag"].get(tag, {}).get("nbytes", 0))


def torch_cache_share_and_limit() -> None:
    """The report splits the tag: a freed tensor's block shows as the cache's share, not in
    use; under a limit the oldest idle blocks are freed (stream-ordered) so the share never
    passes it, and results stay right; empty_cache returns the tag to zero."""
    import torch

    from xlog_actors.interop.torch import use_device

    driver = xa.CudaDriver()
    device = xa.DeviceActor.start(0, driver)
    try:
        route = use_device(device, cache_limit=3 * MIB)
        assert route.cache_limit == 3 * MIB
        kept = torch.full((MIB,), 1.0, device="cuda")  # 4 MiB in use
        scratch = [torch.full((MIB // 4,), float(i), device="cuda") for i in range(4)]  # 1 MiB each
        torch.cuda.synchronize()
        base = _tag_bytes(device, "torch")
        assert base >= 8 * MIB and _cached_bytes(device, "torch") == 0, device.ask(xa.GetStats()).report
        del scratch
        torch.cuda.synchronize()
        # 4 MiB freed, 3 MiB may stay idle: the oldest went back to the device.
        assert _cached_bytes(device, "torch") == 3 * MIB, route.cache_stats()
        assert route.cache_stats()["evicted_blocks"] >= 1
        assert _tag_bytes(device, "torch") == base - MIB
        again = torch.full((MIB // 4,), 9.0, device="cuda")  # a hit: back in use
        assert float(again.sum().item()) == 9.0 * MIB / 4 and float(kept.sum().item()) == 1.0 * MIB
        del again, kept
        gc.collect()
        torch.cuda.synchronize()
        assert _cached_bytes(device, "torch") <= 3 * MIB
        route.allocator.flush()  # the bridge's cache, then the queued frees
        torch.cuda.synchronize()
        assert _tag_bytes(device, "torch") == 0 and _cached_bytes(device, "torch") == 0
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()


def cupy_arrays() -> None:
    """CuPy's arrays come from the device under "cupy", compute right, and are given back;
    restore() puts CuPy's allocator back."""
    import cupy

    from xlog_actors.interop.cupy import use_device

    driver = xa.CudaDriver()
    device = xa.DeviceActor.start(0, driver)
    try:
        previous = cupy.cuda.get_allocator()
        with use_device(device) as route:
            a = cupy.arange(MIB, dtype=cupy.float32)
            b = cupy.random.default_rng(3).standard_normal((256, 256), dtype=cupy.float32)
            total = float((a * 2 + 1).sum())
            product = cupy.asnumpy(b @ b)
            host_b = cupy.asnumpy(b)
            expected = float((np.arange(MIB, dtype=np.float64) * 2 + 1).sum())
            assert abs(total / expected - 1) < 1e-5, (total, expected)
            np.testing.assert_allclose(product, host_b @ host_b, rtol=1e-3, atol=1e-3)
            assert route.allocator.ref(a.data.ptr).tag == "cupy"
            assert _tag_bytes(device, "cupy") >= 4 * MIB
            del a, b
            gc.collect()
            route.allocator.flush()
            cupy.cuda.get_current_stream().synchronize()
            assert _tag_bytes(device, "cupy") == 0, device.ask(xa.GetStats()).report
        assert cupy.cuda.get_allocator() is previous or cupy.cuda.get_allocator() == previous
        c = cupy.ones(1024)  # CuPy's own pool again: not counted by the device
        assert _tag_bytes(device, "cupy") == 0 and float(c.sum()) == 1024.0
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()


def cupy_budget_refusal() -> None:
    """A budget below the need: CuPy's call raises the device's BudgetExceeded (a MemoryError)
    with the report; nothing leaks."""
    import cupy

    from xlog_actors.interop.cupy import use_device

    driver = xa.CudaDriver()
    device = xa.DeviceActor.start(0, driver, resource="async+budget:64MiB")
    try:
        with use_device(device) as route:
            kept = cupy.zeros(MIB, dtype=cupy.uint8)
            try:
                cupy.empty(128 * MIB, dtype=cupy.uint8)
            except MemoryError as exc:
                assert isinstance(exc, xa.BudgetExceeded) and "budget of 64.0 MiB" in str(exc), exc
            else:
                raise AssertionError("a 128 MiB array under a 64 MiB budget was not refused")
            assert _tag_bytes(device, "cupy") == MIB
            del kept
            gc.collect()
            route.allocator.flush()
            assert _tag_bytes(device, "cupy") == 0
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()


def cupy_rebuild() -> None:
    """As torch_rebuild, for CuPy: arrays alive across a rebuild lose their memory (reported);
    new arrays work; the tag returns to zero."""
    import cupy

    from xlog_actors.interop.cupy import use_device

    driver = xa.CudaDriver()
    device = xa.DeviceActor.start(0, driver)
    try:
        with use_device(device) as route:
            old = [cupy.ones(MIB, dtype=cupy.float32) for _ in range(2)]
            cupy.cuda.get_current_stream().synchronize()
            device.ask(xa.Rebuild("scenario"))
            fresh = cupy.full(MIB, 3.0, dtype=cupy.float32)
            assert len(route.allocator.lost_blocks) == 2
            assert float(fresh.sum()) == 3.0 * MIB
            del old, fresh
            gc.collect()
            route.allocator.flush()
            assert _tag_bytes(device, "cupy") == 0 and route.allocator.lost_blocks == {}
    finally:
        pykka.ActorRegistry.stop_all()
        driver.close()


SCENARIOS: dict[str, Callable[..., None]] = {
    f.__name__: f
    for f in (torch_model, torch_budget_refusal, torch_rebuild, torch_cache, torch_cache_share_and_limit, cupy_arrays,
              cupy_budget_refusal, cupy_rebuild)
}


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    SCENARIOS[name](*args)
    print(f"{name}{tuple(args)}: held")
