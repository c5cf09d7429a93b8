"""The null allocator (the ceiling the training-loop rows measure the bridge against), called
through its exported C symbols as torch's pluggable allocator calls them, with stand-in driver
entry points: a miss goes to the driver, a freed block comes back for the next allocation of its
class, a full class gives blocks to the driver's free. The module's state is the library's own,
so each test uses sizes of its own and reads the counters as differences."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from xlog_actors._core import null_allocator

_ALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t)
_FREE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64)


@dataclass
class Driver:
    """Stand-in cuMemAlloc/cuMemFree: hands out increasing addresses, records every call."""

    allocs: list[int] = field(default_factory=list)  # sizes asked
    frees: list[int] = field(default_factory=list)  # pointers freed
    refuse: bool = False
    next_ptr: int = 1 << 40

    def alloc(self, out: ctypes._Pointer[ctypes.c_uint64], nbytes: int) -> int:
        if self.refuse:
            return 2  # CUDA_ERROR_OUT_OF_MEMORY
        self.allocs.append(nbytes)
        out[0] = self.next_ptr
        self.next_ptr += 1 << 28
        return 0

    def free(self, ptr: int) -> int:
        self.frees.append(ptr)
        return 0


@dataclass
class Lib:
    alloc: Any  # the exported functions, typed through ctypes
    free: Any
    driver: Driver


@pytest.fixture
def lib() -> Iterator[Lib]:
    dll = ctypes.CDLL(null_allocator.library_path())
    alloc = dll[null_allocator.ALLOC_SYMBOL]
    alloc.restype, alloc.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    free = dll[null_allocator.FREE_SYMBOL]
    free.restype, free.argtypes = None, [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    driver = Driver()
    callbacks = (_ALLOC(driver.alloc), _FREE(driver.free))  # kept alive while configured
    null_allocator.configure(ctypes.cast(callbacks[0], ctypes.c_void_p).value or 0,
                             ctypes.cast(callbacks[1], ctypes.c_void_p).value or 0)
    try:
        yield Lib(alloc, free, driver)
    finally:
        null_allocator.configure(0, 0)
        del callbacks


def test_a_freed_block_comes_back_for_its_class_without_the_driver(lib: Lib) -> None:
    before = null_allocator.stats()
    first = lib.alloc(3 << 20, 0, None)  # 3 MiB: a class of its own (2 MiB + 2 quarters)
    assert first and lib.driver.allocs == [3 << 20]
    lib.free(first, 3 << 20, 0, None)
    again = lib.alloc((3 << 20) - 4096, 0, None)  # rounds up to the same class
    assert again == first and lib.driver.allocs == [3 << 20]
    after = null_allocator.stats()
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (1, 1)
    lib.free(again, (3 << 20) - 4096, 0, None)


def test_sizes_round_up_to_the_bridges_classes(lib: Lib) -> None:
    for asked, cls in [(700, 1024), (4096, 4096), (4097, 5120), (5 << 20, 5 << 20), ((5 << 20) + 1, 6 << 20)]:
        ptr = lib.alloc(asked, 0, None)
        assert lib.driver.allocs[-1] == cls, (asked, lib.driver.allocs)
        lib.free(ptr, asked, 0, None)


def test_a_full_class_gives_the_extra_blocks_to_the_drivers_free(lib: Lib) -> None:
    size = 7 << 24  # 112 MiB: no other test uses its class
    ptrs = [lib.alloc(size, 0, None) for _ in range(null_allocator.DEPTH + 2)]
    kept = null_allocator.stats()["kept_blocks"]
    for ptr in ptrs:
        lib.free(ptr, size, 0, None)
    assert lib.driver.frees == ptrs[-2:]  # the first DEPTH are kept, the last two go back
    assert null_allocator.stats()["kept_blocks"] == kept + null_allocator.DEPTH


def test_zero_bytes_and_a_refused_miss_give_null(lib: Lib) -> None:
    assert lib.alloc(0, 0, None) is None and lib.driver.allocs == []
    lib.driver.refuse = True
    assert lib.alloc(11 << 24, 0, None) is None
    lib.free(None, 11 << 24, 0, None)  # a null free is ignored
    assert lib.driver.frees == []


def test_without_entry_points_a_miss_gives_null() -> None:
    dll = ctypes.CDLL(null_allocator.library_path())
    alloc = dll[null_allocator.ALLOC_SYMBOL]
    alloc.restype, alloc.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    null_allocator.configure(0, 0)
    assert alloc(13 << 24, 0, None) is None
