"""The compiled one-handle path of the library actors (``_core.library_core.EnqueueCore``): the
work it does and tracks, the operands it leaves to the Python path (having done nothing), and the
host memory it keeps until a copy ran."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import pykka
import pytest

import xlog_actors as xa
from xlog_actors._core.library_core import EnqueueCore
from xlog_actors.actors.library_messages import BufferArg
from xlog_actors.memory.block import Access
from xlog_actors.memory.pinned import PinnedBuffer

KiB = 1 << 10


class _Spy:
    """The resource's tracking calls, recorded, then passed on."""

    def __init__(self, runtime: Any) -> None:
        self.calls: list[tuple[str, Any]] = []
        self._runtime = runtime

    def prepare(self, block: Any, sid: Any, access: Access) -> None:
        self.calls.append(("prepare", access))
        self._runtime.prepare_block_use(block, sid, access)

    def finish(self, block: Any, sid: Any, access: Access) -> None:
        self.calls.append(("finish", access))
        self._runtime.finish_block_use(block, sid, access)


def _core(ref: xa.GpuRef) -> tuple[EnqueueCore, _Spy, Any, Any]:
    ctx = ref.context
    runtime = ctx.runtime
    sid = runtime.stream_pool.acquire()
    stream = runtime.stream_pool.resolve(sid)
    spy = _Spy(runtime)
    core = EnqueueCore(ctx, stream, sid, spy.prepare, spy.finish, Access.READ, Access.WRITE, PinnedBuffer, BufferArg)
    return core, spy, stream, sid


def test_fill_and_pinned_copies_are_done_tracked_and_recorded(device: pykka.ActorRef[Any]) -> None:
    ref = device.ask(xa.Allocate(16 * KiB))
    src = device.ask(xa.AllocatePinned(16 * KiB))
    dst = device.ask(xa.AllocatePinned(16 * KiB))
    core, spy, stream, sid = _core(ref)
    assert core.fill(ref, 7) is True
    assert spy.calls == [("prepare", Access.WRITE), ("finish", Access.WRITE)]
    assert ref.last_write_stream == sid
    event = core.to_host(ref, dst, 16 * KiB)
    assert event is not None
    event.synchronize()
    assert bytes(dst.view()) == b"\x07" * (16 * KiB)
    src.array()[:] = np.arange(16 * KiB, dtype=np.uint64).astype(np.uint8)
    spy.calls.clear()
    assert core.to_device(ref, src) is True
    assert spy.calls == [("prepare", Access.WRITE), ("finish", Access.WRITE)]
    spy.calls.clear()
    event = core.to_host(ref, dst, 100)  # a part lands at the buffer's start
    assert spy.calls == [("prepare", Access.READ), ("finish", Access.READ)]
    event.synchronize()
    np.testing.assert_array_equal(dst.array()[:100], src.array()[:100])
    core.close()
    assert core.kept() == 0


def test_operands_it_does_not_serve_are_left_untouched(device: pykka.ActorRef[Any], driver: xa.Driver) -> None:
    """Each refusal answers False (None for a copy back), with no tracking call and no byte moved:
    the actor's Python path then raises the precise error."""
    ref = device.ask(xa.Allocate(4 * KiB))
    small = device.ask(xa.Allocate(1 * KiB))
    buf = device.ask(xa.AllocatePinned(4 * KiB))
    big = device.ask(xa.AllocatePinned(8 * KiB))
    gone = device.ask(xa.AllocatePinned(4 * KiB))
    gone.release()
    core, spy, stream, _ = _core(ref)
    assert core.fill(ref, 1) is True
    spy.calls.clear()
    released = device.ask(xa.Allocate(4 * KiB))
    released.release()
    assert core.fill(released, 2) is False
    assert core.fill("not a handle", 2) is False
    assert core.to_device(small, buf) is False  # 4 KiB do not fit in 1 KiB
    assert core.to_device(ref, gone) is False
    assert core.to_device(ref, bytes(4 * KiB)) is False  # pageable: the Python path's
    assert core.to_host(ref, big, 8 * KiB) is None  # more than the handle holds
    assert core.to_host(ref, gone, 16) is None
    assert core.to_host(ref, buf, 4 * KiB + 1) is None
    other = xa.HostDriver()
    elsewhere = xa.DeviceActor.start(0, other)
    try:
        foreign = elsewhere.ask(xa.AllocatePinned(4 * KiB))  # pinned, of another driver
        assert core.to_device(ref, foreign) is False
        assert core.to_host(ref, foreign, 16) is None
        foreign.release()
    finally:
        elsewhere.stop()
        other.close()
    assert spy.calls == []
    stream.synchronize()
    assert xa.CopyActor.start(device).ask(xa.CopyToHost(ref)) == b"\x01" * (4 * KiB)
    device.ask(xa.Rebuild("test"))
    assert core.fill(ref, 3) is False  # stale now, and the core's context is closed
    assert spy.calls == []


def test_a_handle_of_another_context_is_left_to_the_python_path(two_devices: xa.Driver) -> None:
    devices = [xa.DeviceActor.start(k, two_devices) for k in (0, 1)]
    try:
        mine = devices[0].ask(xa.Allocate(4 * KiB))
        theirs = devices[1].ask(xa.Allocate(4 * KiB))
        core, spy, _, _ = _core(mine)
        assert core.fill(theirs, 1) is False
        assert spy.calls == []
        copier = xa.CopyActor.start(devices[0])
        with pytest.raises(xa.InvalidRequest):
            copier.ask(xa.Fill(theirs, 1))
    finally:
        pykka.ActorRegistry.stop_all()


def test_the_actors_take_the_compiled_path_on_a_tracked_stack(device: pykka.ActorRef[Any]) -> None:
    copier = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(4 * KiB))
    copier.ask(xa.Fill(ref, 5))
    actor = copier._actor_weakref()
    core = actor._core
    assert isinstance(core, EnqueueCore) and core.context is ref.context
    device.ask(xa.Rebuild("test"))
    fresh = device.ask(xa.Allocate(4 * KiB))
    copier.ask(xa.Fill(fresh, 6))  # re-attached: a new core, of the new context
    assert actor._core is not core and actor._core.context is fresh.context
    assert copier.ask(xa.CopyToHost(fresh)) == b"\x06" * (4 * KiB)
    with pytest.raises(xa.GpuRefStale):
        copier.ask(xa.Fill(ref, 1))


@pytest.mark.parametrize("driver", [pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)], indirect=True)
def test_a_pinned_buffer_stays_until_its_compiled_copy_ran(driver: xa.Driver, device: pykka.ActorRef[Any]) -> None:
    """On CUDA the copy goes straight to ``libcuda``: the core keeps the buffer's memory until the
    copy ran. Without the keep the memory would be freed at release, under the copy. (On the host
    driver the copy goes through the driver's method, which keeps the buffer itself.)"""
    ref = device.ask(xa.Allocate(1 << 20))
    buf = device.ask(xa.AllocatePinned(1 << 20))
    core, _, stream, _ = _core(ref)
    driver.sleep(stream, 300_000)
    assert core.to_device(ref, buf) is True
    owner = weakref.ref(buf._owner)
    buf.release()
    del buf
    gc.collect()
    assert core.kept() == 1
    assert owner() is not None, "released under a copy in flight"
    stream.synchronize()
    core.prune()
    gc.collect()
    assert core.kept() == 0 and owner() is None
    again = device.ask(xa.AllocatePinned(1 << 20))
    driver.sleep(stream, 100_000)
    assert core.to_device(ref, again) is True
    assert core.kept() == 1
    core.close()  # waits for the stream: the memory may go
    assert core.kept() == 0



_PACK_SOURCE = r"""
extern "C" __global__ void xlog_test_pack(unsigned long long* out, const float* in, int a, unsigned int b,
                                          long long c, unsigned long long d, float e, double f) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        out[0] = (unsigned long long)(long long)a;
        out[1] = b;
        out[2] = (unsigned long long)c;
        out[3] = d;
        out[4] = __float_as_uint(e);
        out[5] = (unsigned long long)__double_as_longlong(f);
        out[6] = __float_as_uint(in[0]);
    }
}
"""


def _pack_host(mem: Any, grid: Any, block: Any, out: int, src: int, a: int, b: int, c: int, d: int, e: float,
               f: float) -> None:
    words = mem.array(out, 7, np.uint64)
    words[0] = np.int64(a).view(np.uint64)
    words[1], words[3] = b, d
    words[2] = np.int64(c).view(np.uint64)
    words[4] = np.float32(e).view(np.uint32)
    words[5] = np.float64(f).view(np.uint64)
    words[6] = mem.array(src, 1, np.float32).view(np.uint32)[0]


PACK = xa.Kernel(name="xlog_test_pack", source=_PACK_SOURCE,
                 params=("ptr", "ptr", "i32", "u32", "i64", "u64", "f32", "f64"), host=_pack_host)


def _expected(a: int, b: int, c: int, d: int, e: float, f: float, first: float) -> list[int]:
    return [int(np.int64(a).view(np.uint64)), b, int(np.int64(c).view(np.uint64)), d,
            int(np.float32(e).view(np.uint32)), int(np.float64(f).view(np.uint64)),
            int(np.float32(first).view(np.uint32))]


def test_a_learned_launch_is_packed_tracked_and_recorded(device: pykka.ActorRef[Any]) -> None:
    """The first launch of a kernel and its dimensions takes the Python path; learned, the next
    ones are packed here: every kind at the edges of its range lands in the kernel as the
    driver's own packing puts it (on CUDA through ``cuLaunchKernel`` straight)."""
    out = device.ask(xa.Allocate(64))
    src = device.ask(xa.Allocate(64))
    copier = xa.CopyActor.start(device)
    launcher = xa.KernelActor.start(device)
    copier.ask(xa.CopyToDevice(src, np.array([2.5] * 16, dtype=np.float32)))
    first = xa.Launch(PACK, 1, 1, [xa.Out(out), xa.In(src), 1, 2, 3, 4, 5.0, 6.0])
    launcher.ask(first)  # the Python path: judged, loaded, then learned
    assert copier.ask(xa.CopyToHost(out, 56)) == np.array(_expected(1, 2, 3, 4, 5.0, 6.0, 2.5), np.uint64).tobytes()
    core, spy, stream, sid = _core(out)
    assert core.learn(PACK, 1, 1, ((1, 1, 1), (1, 1, 1))) is True
    edges = (-(1 << 31), (1 << 32) - 1, -(1 << 63), (1 << 64) - 1, -1.5e38, -2.2250738585072014e-308)
    msg = xa.Launch(PACK, 1, 1, [xa.Out(out), xa.In(src), *edges])
    assert core.launch(msg) is True
    assert spy.calls == [("prepare", Access.WRITE), ("prepare", Access.READ),
                         ("finish", Access.WRITE), ("finish", Access.READ)]
    assert out.last_write_stream == sid and src.last_write_stream != sid
    stream.synchronize()
    got = copier.ask(xa.CopyToHost(out, 56))
    assert got == np.array(_expected(*edges, 2.5), np.uint64).tobytes()
    ints = xa.Launch(PACK, 1, 1, [xa.Out(out), xa.In(src), 0, 0, 0, 0, 7, 8])  # ints for the reals
    assert core.launch(ints) is True
    stream.synchronize()
    assert copier.ask(xa.CopyToHost(out, 56)) == np.array(_expected(0, 0, 0, 0, 7.0, 8.0, 2.5), np.uint64).tobytes()
    core.close()


def test_launches_it_does_not_pack_are_left_untouched(device: pykka.ActorRef[Any]) -> None:
    out = device.ask(xa.Allocate(64))
    src = device.ask(xa.Allocate(64))
    core, spy, _, _ = _core(out)

    def launch(*args: object, grid: object = 1, block: object = 1, kernel: xa.Kernel = PACK) -> bool:
        return bool(core.launch(xa.Launch(kernel, grid, block, list(args))))

    good = [xa.Out(out), xa.In(src), 1, 2, 3, 4, 5.0, 6.0]
    assert launch(*good) is False  # not learned yet
    assert core.learn(PACK, 1, 1, ((1, 1, 1), (1, 1, 1))) is True
    assert core.learn(PACK, (1, 1), 1, ((1, 1, 1), (1, 1, 1))) is False  # dimensions not plain ints
    assert launch(*good, grid=2) is False  # another triple
    assert launch(*good, grid=(1, 1)) is False
    assert launch(*good[:-1]) is False
    assert launch(*good, 7) is False
    stale = device.ask(xa.Allocate(64))
    stale.release()
    rows: list[list[object]] = [
        [out, xa.In(src), 1, 2, 3, 4, 5.0, 6.0],  # a bare handle
        [xa.Out(stale), xa.In(src), 1, 2, 3, 4, 5.0, 6.0],
        [xa.Out(out), xa.In(out), 1, 2, 3, 4, 5.0, 6.0],  # one handle twice
        [xa.Out(out), xa.In(src), True, 2, 3, 4, 5.0, 6.0],
        [xa.Out(out), xa.In(src), 1 << 31, 2, 3, 4, 5.0, 6.0],
        [xa.Out(out), xa.In(src), 1, -1, 3, 4, 5.0, 6.0],
        [xa.Out(out), xa.In(src), 1, 1 << 32, 3, 4, 5.0, 6.0],
        [xa.Out(out), xa.In(src), 1, 2, 1 << 63, 4, 5.0, 6.0],
        [xa.Out(out), xa.In(src), 1, 2, 3, -1, 5.0, 6.0],
        [xa.Out(out), xa.In(src), 1, 2, 3, 1 << 64, 5.0, 6.0],
        [xa.Out(out), xa.In(src), 1, 2, 3.0, 4, 5.0, 6.0],
        [xa.Out(out), xa.In(src), 1, 2, 3, 4, 1e39, 6.0],  # saturates on the Python path
        [xa.Out(out), xa.In(src), 1, 2, 3, 4, 10**400, 6.0],
        [xa.Out(out), xa.In(src), 1, 2, 3, 4, "5", 6.0],
        [xa.Out(out), xa.In(src), 1, 2, 3, 4, 5.0, np.float64(6.0)],
    ]
    for row in rows:
        assert launch(*row) is False, row
    assert spy.calls == []
    assert core.launch(xa.Launch(PACK, 1, 1, tuple(good))) is True  # a tuple of arguments is served
    spy.calls.clear()
    device.ask(xa.Rebuild("test"))
    assert launch(*good) is False  # the core's context closed
    assert spy.calls == []


def test_a_copy_back_event_is_reused_only_once_nobody_holds_it(device: pykka.ActorRef[Any]) -> None:
    """A ``CopyDone``'s event is re-recorded for a later copy back only when nothing but the core
    holds it: one still held keeps marking its own copy."""
    ref = device.ask(xa.Allocate(4 * KiB))
    out = device.ask(xa.AllocatePinned(4 * KiB))
    core, _, stream, _ = _core(ref)
    first = core.to_host(ref, out, 16)
    second = core.to_host(ref, out, 16)
    assert first is not None and second is not None and first is not second
    first_id = id(first)
    held = second
    del first, second
    stream.synchronize()
    third = core.to_host(ref, out, 16)
    assert id(third) == first_id, "the first event, dropped by everyone, is recorded again"
    fourth = core.to_host(ref, out, 16)
    assert fourth is not held and fourth is not third, "an event still held is never moved"
    fourth.synchronize()
    assert held.query() and third.query()
    core.close()
