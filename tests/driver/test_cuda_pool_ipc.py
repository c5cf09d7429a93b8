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
