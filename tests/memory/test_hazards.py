"""Cross-stream hazards: each is shown to corrupt data when tracking is skipped and to be correct
with it. The untracked variant asserts that the corruption is observed: that is what proves the
tracked variant can fail. Sleeps only make each race deterministic (the slow side is still
running when the fast side acts); the assertions are on data.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

import xlog_actors as xa
from xlog_actors import Access, AsyncCudaResource, BlockId, DeviceBlock, StreamId, StreamPool

SLOW_US = 150_000
N = 64 * 1024

TRACKED = pytest.mark.parametrize("tracked", [True, False], ids=["tracked", "untracked"])


class Env:
    def __init__(self, driver: xa.Driver) -> None:
        self.driver = driver
        self.pool = StreamPool(driver, 0)
        self.res = AsyncCudaResource(driver, 0, self.pool)
        self.a = self.pool.acquire()
        self.b = self.pool.acquire()
        # Device buffers outside the resource, allocated before any race starts. Racing reads and
        # writes are device-to-device copies from/into them: on CUDA a device-to-host copy into
        # pageable memory returns only once it ran, and a pageable host-to-device copy may
        # synchronize with its stream, either of which would end the race a test sets up.
        self._scratch = [driver.alloc(0, N) for _ in range(2)]

    def s(self, sid: StreamId) -> xa.Stream:
        stream = self.pool.resolve(sid)
        assert stream is not None
        return stream

    def use(
        self, tracked: bool, block: DeviceBlock, sid: StreamId, access: Access, work: object
    ) -> None:
        """Enqueue ``work()`` on ``sid`` as a use of ``block``, bracketed by the tracking hooks
        when ``tracked``."""
        if tracked:
            self.res.prepare_block_use(BlockId.from_block(block), sid, access)
        work()  # type: ignore[operator]  # a callable, typed object to take any
        if tracked:
            self.res.finish_block_use(BlockId.from_block(block), sid, access)

    def sync_all(self) -> None:
        for sid in self.pool.ids():
            self.s(sid).synchronize()

    def staged(self, payload: bytes) -> int:
        """A scratch buffer holding ``payload``, ready before the race starts."""
        ptr = self._scratch[0]
        self.driver.copy_to_device(ptr, payload, self.s(self.a))
        self.s(self.a).synchronize()
        return ptr

    def read_into_scratch(self, block: DeviceBlock, sid: StreamId) -> None:
        self.driver.copy_device_to_device(self._scratch[1], block.ptr, N, self.s(sid))

    def scratch_read(self) -> bytes:
        """What ``read_into_scratch`` copied, once every stream is synchronized."""
        self.sync_all()
        out = self.driver.copy_to_host(self._scratch[1], N, self.s(self.a))
        self.s(self.a).synchronize()
        return bytes(out)

    def close(self) -> None:
        self.sync_all()
        self.res.reap_pending()
        assert self.res.bytes_outstanding() == 0
        for ptr in self._scratch:
            self.driver.free(0, ptr)
        self.pool.close()


@pytest.fixture
def env(driver: xa.Driver) -> Iterator[Env]:
    e = Env(driver)
    yield e
    e.close()


def data(seed: int) -> bytes:
    return random.Random(seed).randbytes(N)


@TRACKED
@pytest.mark.parametrize("alloc_on", ["writer-stream", "third-stream"])
def test_slow_writer_on_a_reader_on_b(env: Env, tracked: bool, alloc_on: str) -> None:
    """The block is allocated on the writer's stream A (the reader then waits on the allocation
    fence, recorded after the write) or on a third stream (it waits on A's ``last_write``)."""
    drv, a, b = env.driver, env.a, env.b
    x = env.res.allocate(N, a if alloc_on == "writer-stream" else env.pool.acquire())
    stale, fresh = data(1), data(2)
    env.use(tracked, x, a, Access.WRITE, lambda: drv.copy_to_device(x.ptr, stale, env.s(a)))
    src = env.staged(fresh)  # synchronizes A

    def slow_write() -> None:
        drv.sleep(env.s(a), SLOW_US)
        drv.copy_device_to_device(x.ptr, src, N, env.s(a))

    env.use(tracked, x, a, Access.WRITE, slow_write)
    out: list[bytearray] = []
    env.use(tracked, x, b, Access.READ, lambda: out.append(drv.copy_to_host(x.ptr, N, env.s(b))))
    env.s(b).synchronize()
    if tracked:
        assert out[0] == fresh, "the reader on B did not wait for the writer on A"
    else:
        assert out[0] == stale, "untracked, the reader should have raced ahead of the slow writer"
    env.sync_all()
    env.res.deallocate(x)


@TRACKED
def test_slow_writer_with_fill_on_a_reader_on_b(env: Env, tracked: bool) -> None:
    drv, a, b = env.driver, env.a, env.b
    x = env.res.allocate(N, a)
    env.use(tracked, x, a, Access.WRITE, lambda: drv.fill(x.ptr, 0x11, N, env.s(a)))
    env.s(a).synchronize()

    def slow_fill() -> None:
        drv.sleep(env.s(a), SLOW_US)
        drv.fill(x.ptr, 0xAB, N, env.s(a))

    env.use(tracked, x, a, Access.WRITE, slow_fill)
    out: list[bytearray] = []
    env.use(tracked, x, b, Access.READ, lambda: out.append(drv.copy_to_host(x.ptr, N, env.s(b))))
    env.s(b).synchronize()
    assert out[0] == bytes([0xAB if tracked else 0x11]) * N
    env.sync_all()
    env.res.deallocate(x)


@TRACKED
@pytest.mark.parametrize("hook", ["finish", "record_block_use"])
def test_reader_on_b_outlives_a_free_and_reuse_on_a(env: Env, tracked: bool, hook: str) -> None:
    """A reader on B is still running (it sleeps before its copy) when the block is freed on A,
    the address is handed out again on A and filled there."""
    drv, a, b = env.driver, env.a, env.b
    x = env.res.allocate(N, a)
    original = data(3)
    drv.copy_to_device(x.ptr, original, env.s(a))
    env.s(a).synchronize()

    if tracked:
        env.res.prepare_block_use(BlockId.from_block(x), b, Access.READ)
    drv.sleep(env.s(b), SLOW_US)
    env.read_into_scratch(x, b)
    if tracked:
        if hook == "finish":
            env.res.finish_block_use(BlockId.from_block(x), b, Access.READ)
        else:
            env.res.record_block_use(x, b)
    env.res.deallocate(x)

    y = env.res.allocate(N, a)  # same stream, same size
    if y.ptr != x.ptr and not tracked:
        env.sync_all()
        env.res.deallocate(y)
        pytest.skip("this driver did not hand the address out again at once: no race to show")
    env.use(tracked, y, a, Access.WRITE, lambda: drv.fill(y.ptr, 0x77, N, env.s(a)))
    out = env.scratch_read()
    if tracked:
        assert out == original, "the reader on B saw the next owner's bytes: freed under it"
    else:
        assert out == bytes([0x77]) * N, (
            "untracked, the free and the refill should have run under the reader"
        )
    env.sync_all()
    env.res.deallocate(y)


@TRACKED
def test_first_use_on_b_of_an_address_freed_behind_slow_work_on_a(env: Env, tracked: bool) -> None:
    """The allocation-ready fence. The previous owner's last write on A is still behind slow work
    when it frees the block; the address comes back at once on A, and the new owner's first user
    is on B. Without the fence B writes first and the previous owner's late write (and, on the host
    driver, the free's poison) then wipes B's bytes."""
    drv, a, b = env.driver, env.a, env.b
    payload = data(4)
    src = env.staged(payload)
    x = env.res.allocate(N, a)
    drv.sleep(env.s(a), SLOW_US)
    drv.fill(x.ptr, 0xEE, N, env.s(a))  # the previous owner's late write, on its own stream
    env.res.deallocate(x)
    y = env.res.allocate(N, a)
    if y.ptr != x.ptr and not tracked:
        env.sync_all()
        env.res.deallocate(y)
        pytest.skip("this driver did not hand the address out again at once: no race to show")
    env.use(tracked, y, b, Access.WRITE, lambda: drv.copy_device_to_device(y.ptr, src, N, env.s(b)))
    env.sync_all()
    out = drv.copy_to_host(y.ptr, N, env.s(b))
    env.s(b).synchronize()
    if tracked:
        assert out == payload, "B wrote before the block's allocation was ready on A"
    else:
        assert out in (bytes([0xEE]) * N, bytes([0xDD]) * N), (
            "untracked, the previous owner's late write (or its free) should have clobbered B's write"
        )
    env.res.deallocate(y)


@TRACKED
def test_writer_on_b_waits_for_a_slow_reader_on_c(env: Env, tracked: bool) -> None:
    """Write-after-read: a writer on B must not overwrite bytes a slow reader on C has not read."""
    drv, a, b = env.driver, env.a, env.b
    c = env.pool.acquire()
    x = env.res.allocate(N, a)
    original = data(5)
    env.use(tracked, x, a, Access.WRITE, lambda: drv.copy_to_device(x.ptr, original, env.s(a)))
    env.s(a).synchronize()

    def slow_read() -> None:
        drv.sleep(env.s(c), SLOW_US)
        env.read_into_scratch(x, c)

    env.use(tracked, x, c, Access.READ, slow_read)
    env.use(tracked, x, b, Access.WRITE, lambda: drv.fill(x.ptr, 0x99, N, env.s(b)))
    out = env.scratch_read()
    if tracked:
        assert out == original
    else:
        assert out == bytes([0x99]) * N
    env.res.deallocate(x)


@TRACKED
def test_writer_on_b_outlives_a_free_and_reuse_on_a(env: Env, tracked: bool) -> None:
    """A slow writer on B is still running when the block is freed on A and the address is handed
    out again on A and filled there: untracked, the late write lands in the next owner's bytes."""
    drv, a, b = env.driver, env.a, env.b
    x = env.res.allocate(N, a)
    src = env.staged(data(6))

    def slow_write() -> None:
        drv.sleep(env.s(b), SLOW_US)
        drv.copy_device_to_device(x.ptr, src, N, env.s(b))

    env.use(tracked, x, b, Access.WRITE, slow_write)
    env.res.deallocate(x)
    y = env.res.allocate(N, a)
    if y.ptr != x.ptr and not tracked:
        env.sync_all()
        env.res.deallocate(y)
        pytest.skip("this driver did not hand the address out again at once: no race to show")
    env.use(tracked, y, a, Access.WRITE, lambda: drv.fill(y.ptr, 0x77, N, env.s(a)))
    env.sync_all()
    out = drv.copy_to_host(y.ptr, N, env.s(a))
    env.s(a).synchronize()
    if tracked:
        assert out == bytes([0x77]) * N, (
            "a write to the freed block landed in the next owner's bytes"
        )
    else:
        assert out == data(6), "untracked, the late write should have clobbered the next owner"
    env.res.deallocate(y)
