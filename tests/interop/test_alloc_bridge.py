"""The compiled allocator bridge (``xlog_actors._core.alloc_bridge``) loaded as PyTorch loads it,
by path and symbol, here with ctypes, against a device on the host driver: what torch's
``CUDAPluggableAllocator`` would call, proved without torch. ctypes releases the GIL around
each call, so every call below also proves the bridge takes it back itself."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pykka
import pytest

import xlog_actors as xa
from xlog_actors._core import alloc_bridge
from xlog_actors.interop import DeviceAllocator, as_client

ROOT = Path(__file__).resolve().parents[2]
SYMBOLS = (alloc_bridge.ALLOC_SYMBOL, alloc_bridge.ALLOC_OR_NULL_SYMBOL, alloc_bridge.FREE_SYMBOL)


class Bridge:
    """The three exported functions, typed as torch declares them."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(alloc_bridge.library_path())
        self.alloc_or_null = lib[alloc_bridge.ALLOC_OR_NULL_SYMBOL]
        self.alloc_or_null.restype = ctypes.c_void_p
        self.alloc_or_null.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        self.free = lib[alloc_bridge.FREE_SYMBOL]
        self.free.restype = None
        self.free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]


@pytest.fixture
def bridge() -> Bridge:
    return Bridge()


@pytest.fixture
def routed(host_driver: xa.HostDriver) -> Iterator[tuple[pykka.ActorRef[Any], DeviceAllocator]]:
    """Device 1 of the host driver (so a wrong ordinal shows), budget 8 MiB, routed under "torch"."""
    device = xa.DeviceActor.start(1, host_driver, resource="async+budget:8MiB")
    allocator = DeviceAllocator(as_client(device), "torch")
    alloc_bridge.register(1, allocator)
    yield device, allocator
    alloc_bridge.unregister(1)
    device.stop()


def _tag_bytes(device: pykka.ActorRef[Any], tag: str = "torch") -> int:
    by_tag = device.ask(xa.GetStats()).report["by_tag"]
    return int(by_tag.get(tag, {}).get("nbytes", 0))


def test_the_library_exports_the_three_functions_with_c_names() -> None:
    lib = ctypes.CDLL(alloc_bridge.library_path())
    for name in SYMBOLS:
        assert getattr(lib, name) is not None
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm is not installed: the dynamic symbol table was checked through dlsym only")
    table = subprocess.run([nm, "-D", "--defined-only", alloc_bridge.library_path()], capture_output=True, text=True,
                           check=True).stdout
    exported = {line.split()[-1] for line in table.splitlines() if " T " in line}
    assert set(SYMBOLS) <= exported, table


def test_alloc_and_free_count_under_the_tag_and_give_everything_back(routed: Any, bridge: Bridge) -> None:
    device, allocator = routed
    sizes = [4096, 100_000, 1 << 20]
    classes = [alloc_bridge.size_class(n) for n in sizes]
    assert classes == [4096, 114_688, 1 << 20]  # 100,000 up to 112 KiB: a quarter of 64 KiB steps
    ptrs = [bridge.alloc_or_null(n, 1, 0) for n in sizes]
    assert all(ptrs) and len(set(ptrs)) == 3
    assert _tag_bytes(device) == sum(classes)
    assert allocator.live_blocks == 3 and allocator.ref(ptrs[0]).tag == "torch"
    for ptr, n in zip(ptrs, sizes, strict=True):
        bridge.free(ptr, n, 1, 0)
    # Cached: still allocated and counted, as torch's reserved bytes, until the cache is emptied.
    assert allocator.live_blocks == 3 and _tag_bytes(device) == sum(classes)
    assert alloc_bridge.empty_cache(1) == sum(classes)
    assert allocator.live_blocks == 0
    assert _tag_bytes(device) == 0
    assert device.ask(xa.GetStats()).bytes_outstanding == 0
    assert alloc_bridge.last_error(1) is None


def test_a_budget_refusal_returns_null_changes_nothing_and_keeps_the_report(routed: Any, bridge: Bridge) -> None:
    device, allocator = routed
    held = bridge.alloc_or_null(1 << 20, 1, 0)
    before = device.ask(xa.GetStats()).bytes_outstanding
    assert bridge.alloc_or_null(16 << 20, 1, 0) is None
    error = alloc_bridge.last_error(1)
    assert isinstance(error, xa.BudgetExceeded)
    assert "budget of 8.0 MiB" in str(error) and "torch" in str(error)
    assert device.ask(xa.GetStats()).bytes_outstanding == before
    assert allocator.live_blocks == 1
    bridge.free(held, 1 << 20, 1, 0)
    allocator.flush()  # empties the cache too
    assert _tag_bytes(device) == 0


def test_zero_bytes_is_null_without_an_error(routed: Any, bridge: Bridge) -> None:
    device, allocator = routed
    assert bridge.alloc_or_null(0, 1, 0) is None
    assert alloc_bridge.last_error(1) is None and allocator.live_blocks == 0
    bridge.free(None, 0, 1, 0)  # torch frees the null of an empty tensor: nothing happens
    assert alloc_bridge.last_error(1) is None


def test_an_unrouted_device_is_refused_and_a_bad_free_is_kept_as_the_last_error(
    routed: Any, bridge: Bridge, caplog: pytest.LogCaptureFixture
) -> None:
    device, _ = routed
    assert bridge.alloc_or_null(4096, 0, 0) is None
    assert isinstance(alloc_bridge.last_error(0), LookupError)
    assert "CUDA device 0" in str(alloc_bridge.last_error(0))
    bridge.free(0x1234, 16, 1, 0)  # never handed out: refused, logged, nothing changes
    assert isinstance(alloc_bridge.last_error(1), xa.InvalidRequest)
    assert "free of 0x1234" in caplog.text
    assert device.ask(xa.GetStats()).bytes_outstanding == 0


def test_registration_is_checked(routed: Any) -> None:
    _, allocator = routed
    with pytest.raises(ValueError, match=">= 0"):
        alloc_bridge.register(-1, allocator)
    with pytest.raises(TypeError, match="allocate"):
        alloc_bridge.register(3, object())
    with pytest.raises(ValueError, match="already routes"):
        alloc_bridge.register(1, DeviceAllocator(allocator._client, "other"))
    assert alloc_bridge.registered(1) is allocator
    assert not alloc_bridge.unregister(1, object())  # not the one registered: kept
    assert alloc_bridge.registered(1) is allocator


def test_threads_allocating_and_freeing_at_once_leave_nothing(routed: Any, bridge: Bridge) -> None:
    device, allocator = routed
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for i in range(200):
                n = 4096 + 256 * (i % 7)
                ptr = bridge.alloc_or_null(n, 1, 0)
                assert ptr, alloc_bridge.last_error(1)
                bridge.free(ptr, n, 1, 0)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    stats = alloc_bridge.cache_stats(1)
    assert stats["hits"] + stats["misses"] == 800 and stats["live_blocks"] == 0
    alloc_bridge.empty_cache(1)
    assert allocator.live_blocks == 0 and _tag_bytes(device) == 0
    assert alloc_bridge.last_error(1) is None


_THROWS = """
import ctypes, resource, sys
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
import xlog_actors as xa
from xlog_actors._core import alloc_bridge
from xlog_actors.interop import DeviceAllocator, as_client
device = xa.DeviceActor.start(0, xa.HostDriver(), resource="async+budget:1MiB")
alloc_bridge.register(0, DeviceAllocator(as_client(device), "torch"))
alloc = ctypes.CDLL(alloc_bridge.library_path())[alloc_bridge.ALLOC_SYMBOL]
alloc.restype = ctypes.c_void_p
alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
assert alloc(0, 0, None) is None
assert alloc(4096, 0, None)
print("allocated", flush=True)
alloc(2 << 20, 0, None)  # C cannot catch the C++ exception: std::terminate prints it
print("not reached", flush=True)
"""


def test_the_throwing_alloc_carries_the_refusal_as_a_cpp_exception() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _THROWS], capture_output=True, text=True, env=env, timeout=60,
                          check=False)
    assert proc.returncode != 0
    assert "allocated" in proc.stdout and "not reached" not in proc.stdout
    assert "std::runtime_error" in proc.stderr, proc.stderr
    assert "BudgetExceeded: budget of 1.0 MiB" in proc.stderr, proc.stderr
