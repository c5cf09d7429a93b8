"""The IPC-capable pool's host-side logic (``xlog_actors.driver.cuda.pool_ipc``): what it refuses,
and what a retired pool leaves, without a GPU. The GPU paths (export and import across a spawned
process, hazard ordering, release order, staleness) are in tests/actors/test_shared_ref.py,
marked ``gpu``."""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator

import pytest

import xlog_actors as xa
from xlog_actors.driver.cuda import pool_ipc
from xlog_actors.driver.cuda.importer import HANDLE_BYTES, struct_of
from xlog_actors.driver.cuda.pool_ipc import CudaPoolExport, export_pointer, open_pointer, retire_pool
from xlog_actors.driver.fd_passing import FdServer, served
from xlog_actors.errors import DeviceUnavailable, InvalidRequest

OTHER_PID = os.getpid() + 1  # any pid but ours: the import path, not the owner's shortcut


@pytest.fixture
def owned_pool() -> Iterator[tuple[int, str]]:
    """A stand-in pool registered as made here, its fd (a pipe end) exported and offered, as the
    first export of a real pool leaves it."""
    read_end, write_end = os.pipe()
    os.close(write_end)
    handle = 0x7E57_0000 + os.getpid()
    record = pool_ipc._Owned(f"pool-test-{handle}")
    pool_ipc._owned[handle] = record
    served().offer(record.key, read_end)
    record.fd = read_end
    yield handle, record.key
    retire_pool(handle, destroy=False)


def test_ipc_pool_takes_only_a_bool() -> None:
    for bad in ("yes", 1, None):
        with pytest.raises(InvalidRequest, match="ipc_pool"):
            xa.CudaDriver(ipc_pool=bad)  # type: ignore[arg-type]


def test_a_pool_not_made_here_is_not_exported() -> None:
    before = served().offered()
    with pytest.raises(InvalidRequest, match="not made IPC-capable"):
        export_pointer(0, 0x1000, 64, 0xDEAD)
    assert served().offered() == before and not pool_ipc.is_shareable(0xDEAD)


def test_a_retired_pool_withdraws_its_fd_and_a_late_first_import_is_refused(owned_pool: tuple[int, str]) -> None:
    handle, key = owned_pool
    assert pool_ipc.is_shareable(handle) and key in served().offered()
    export = CudaPoolExport(served().address, key, bytes(HANDLE_BYTES), 64, OTHER_PID, 0x1000)
    assert pickle.loads(pickle.dumps(export)) == export
    retire_pool(handle, destroy=False)
    retire_pool(handle, destroy=False)  # a second retire, and one of a pool not made here: no-ops
    assert not pool_ipc.is_shareable(handle) and key not in served().offered()
    with pytest.raises(DeviceUnavailable, match="nothing is offered"):
        open_pointer(0, export)
    with pytest.raises(InvalidRequest, match="not made IPC-capable"):
        export_pointer(0, 0x1000, 64, handle)


def test_an_import_from_a_gone_owner_is_device_unavailable() -> None:
    server = FdServer()
    address = server.address
    server.close()
    export = CudaPoolExport(address, "pool-0-0", bytes(HANDLE_BYTES), 64, OTHER_PID, 0x1000)
    with pytest.raises(DeviceUnavailable, match="nobody serves"):
        open_pointer(0, export)
    assert not pool_ipc._imported_pools, "nothing was imported"


def test_an_import_in_the_owners_process_is_the_owners_address() -> None:
    export = CudaPoolExport("\0xlog-fds-unused", "pool-0-0", bytes(HANDLE_BYTES), 64, os.getpid(), 0xABC000)
    assert open_pointer(0, export).ptr(export) == 0xABC000


@pytest.mark.parametrize("data", [b"", bytes(HANDLE_BYTES - 1), bytes(HANDLE_BYTES + 1), "x" * HANDLE_BYTES])
def test_export_data_of_the_wrong_size_is_refused(data: object) -> None:
    from cuda.bindings import driver as cu

    with pytest.raises(InvalidRequest, match="64 bytes"):
        struct_of(cu.CUmemPoolPtrExportData, data)  # type: ignore[arg-type]


class _FakeCu:
    """``cuda.bindings.driver`` for the importer's pool calls, counted (the rest is the real
    module)."""

    def __init__(self, real: object) -> None:
        self._real = real
        self.pools = 0
        self.destroyed: list[int] = []
        self.freed: list[int] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)

    def cuMemPoolImportFromShareableHandle(self, _fd: int, _kind: object, _flags: int) -> tuple[object, int]:
        self.pools += 1
        return self._real.CUresult.CUDA_SUCCESS, 0x1000 * self.pools  # type: ignore[attr-defined]

    def cuMemPoolImportPointer(self, pool: int, data: object) -> tuple[object, int]:
        return self._real.CUresult.CUDA_SUCCESS, pool + 0x10 + len(self.freed)  # type: ignore[attr-defined]

    def cuMemFree(self, base: int) -> tuple[object]:
        self.freed.append(base)
        return (self._real.CUresult.CUDA_SUCCESS,)  # type: ignore[attr-defined]

    def cuMemPoolDestroy(self, pool: int) -> tuple[object]:
        self.destroyed.append(pool)
        return (self._real.CUresult.CUDA_SUCCESS,)  # type: ignore[attr-defined]


def test_an_imported_pool_no_block_uses_goes_when_its_device_imports_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """An imported pool keeps its owner's memory alive after the owner destroyed it (a rebuild
    retires the owner's pool): it goes at the next first import of a pool of the same device,
    once no block of it is imported here; a pool still in use waits for the next one."""
    import gc

    from cuda.bindings import driver as real_cu

    from xlog_actors.driver.cuda import importer

    fake = _FakeCu(real_cu)
    monkeypatch.setattr(pool_ipc, "cu", fake)
    monkeypatch.setattr(pool_ipc, "make_current", lambda _ordinal: None)
    monkeypatch.setattr(importer, "make_current", lambda _ordinal: None)
    monkeypatch.setattr(pool_ipc, "fetch_fd", lambda *_args: os.open(os.devnull, os.O_RDONLY))
    monkeypatch.setattr(pool_ipc, "_imported_pools", {})

    def export(key: str, n: int) -> CudaPoolExport:
        return CudaPoolExport("\0xlog-fds-fake", key, bytes([n]) * HANDLE_BYTES, 64, OTHER_PID, 0x1000)

    first = open_pointer(0, export("pool-0-1", 1))
    second = open_pointer(0, export("pool-0-2", 2))  # the owner's next pool: the first is still used
    assert fake.pools == 2 and fake.destroyed == []
    del first
    gc.collect()
    assert fake.freed == [0x1010]
    other_device = open_pointer(1, export("pool-1-1", 3))  # another device's pools are not touched
    assert fake.destroyed == []
    third = open_pointer(0, export("pool-0-3", 4))
    assert fake.destroyed == [0x1000], "the unused pool of device 0 goes; the used one stays"
    assert set(pool_ipc._imported_pools) == {("\0xlog-fds-fake", k) for k in ("pool-0-2", "pool-1-1", "pool-0-3")}
    del second
    gc.collect()
    again = open_pointer(0, export("pool-0-3", 5))  # a pool imported already: nothing is dropped
    assert fake.destroyed == [0x1000]
    fourth = open_pointer(0, export("pool-0-4", 6))
    assert sorted(fake.destroyed) == [0x1000, 0x2000], "the second goes once its block went"
    del other_device, third, again, fourth
    gc.collect()
