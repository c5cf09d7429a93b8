"""Pinned host buffers through the actors: ``AllocatePinned``, ``CopyToDevice`` from one,
``CopyToHost(out=...)`` replying at once with a ``CopyDone``, the release-while-in-flight
invariant, bad input, and the accounting in ``GetStats``/``GetReport``."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pykka
import pytest

import xlog_actors as xa

MiB = 1 << 20


def _pinned(device: pykka.ActorRef) -> tuple[int, int]:
    stats = device.ask(xa.GetStats())
    return stats.pinned_count, stats.pinned_bytes


def _eventually(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Whether ``check()`` became true within ``timeout`` (a finalizer runs on the thread that
    drops the last reference, a moment after the event that marks the copy fired)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _slow_stream(device: pykka.ActorRef, copier: pykka.ActorRef, ref: xa.GpuRef) -> xa.Stream:
    return ref.context.runtime.stream_pool.resolve(copier.proxy().stream_id.get())


def test_round_trip_through_pinned_buffers(device: pykka.ActorRef) -> None:
    copier = xa.CopyActor.start(device)
    n = 1 << 16
    ref = device.ask(xa.Allocate(4 * n))
    src = device.ask(xa.AllocatePinned(4 * n, tag=xa.AllocTag("in")))
    dst = device.ask(xa.AllocatePinned(4 * n, tag=xa.AllocTag("out")))
    assert isinstance(src, xa.PinnedBuffer) and src.nbytes == 4 * n and src.tag == "in"
    src.array(np.float32)[:] = np.arange(n, dtype=np.float32)
    copier.ask(xa.CopyToDevice(ref, src))
    done = copier.ask(xa.CopyToHost(ref, out=dst))
    assert isinstance(done, xa.CopyDone) and done.out is dst and done.nbytes == 4 * n
    done.wait(timeout=30)
    assert done.done()
    np.testing.assert_array_equal(dst.array(np.float32), np.arange(n, dtype=np.float32))
    # A partial copy lands at the start of a larger buffer and leaves the rest alone.
    dst.array()[:] = 0xEE
    copier.ask(xa.CopyToHost(ref, nbytes=16, out=dst)).wait()
    assert dst.array(np.float32, 4).tolist() == [0.0, 1.0, 2.0, 3.0]
    assert (dst.array()[16:] == 0xEE).all()
    # The same bytes as the synchronous path.
    assert copier.ask(xa.CopyToHost(ref)) == src.array().tobytes()


def test_copy_done_waits_for_the_write_it_follows(device: pykka.ActorRef, driver: xa.Driver) -> None:
    """The copy back is ordered after a slow write on another actor's stream: its CopyDone is
    not done before that write ran, and then holds the written bytes."""
    writer, reader = xa.CopyActor.start(device), xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(MiB))
    out = device.ask(xa.AllocatePinned(MiB))
    reader.ask(xa.Fill(ref, 1))
    reader.ask(xa.CopyToHost(ref, nbytes=1))
    driver.sleep(_slow_stream(device, writer, ref), 300_000)
    writer.ask(xa.Fill(ref, 7))
    done = reader.ask(xa.CopyToHost(ref, out=out))
    assert not done.done()
    with pytest.raises(TimeoutError):
        done.wait(timeout=0.01)
    done.wait(timeout=30)
    assert (out.array() == 7).all()


@pytest.mark.parametrize("direction", ["to_host", "to_device"])
def test_a_buffer_released_in_flight_is_freed_only_after_its_copy(
    device: pykka.ActorRef, driver: xa.Driver, direction: str
) -> None:
    """The copy waits behind a slow stream; the buffer is released at once. Its bytes stay
    counted (not freed) until the copy ran, then go. An eager release fails this test."""
    copier = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(4 * MiB))
    buf = device.ask(xa.AllocatePinned(4 * MiB, tag=xa.AllocTag("in flight")))
    buf.array()[:] = 9
    copier.ask(xa.Fill(ref, 3))
    copier.ask(xa.CopyToHost(ref, nbytes=1))
    driver.sleep(_slow_stream(device, copier, ref), 400_000)
    done = None
    if direction == "to_host":
        done = copier.ask(xa.CopyToHost(ref, out=buf))
    else:
        copier.ask(xa.CopyToDevice(ref, buf))
    buf.release()
    buf.release()  # idempotent
    assert buf.released
    assert _pinned(device) == (1, 4 * MiB), "released while its copy was in flight: freed too early"
    if done is not None:
        assert not done.done()
        done.wait(timeout=30)
    # A synchronous copy on the same stream: everything before it ran, and the stream let go
    # of the buffers of its finished copies.
    assert copier.ask(xa.CopyToHost(ref, nbytes=1)) == (b"\x03" if direction == "to_host" else b"\x09")
    assert _eventually(lambda: _pinned(device) == (0, 0))


def test_bad_pinned_requests_change_nothing(device: pykka.ActorRef, driver: xa.Driver) -> None:
    copier = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(4096))
    copier.ask(xa.Fill(ref, 5))
    small = device.ask(xa.AllocatePinned(1024, tag=xa.AllocTag("small")))
    before = device.ask(xa.GetStats())
    bad: list[tuple[object, str]] = [
        (xa.AllocatePinned(0), "AllocatePinned.nbytes"),
        (xa.AllocatePinned(-5), "AllocatePinned.nbytes"),
        (xa.AllocatePinned(1.5), "AllocatePinned.nbytes"),  # type: ignore[arg-type]
        (xa.AllocatePinned(True), "AllocatePinned.nbytes"),  # type: ignore[arg-type]
        (xa.AllocatePinned(64, tag=3), "AllocatePinned.tag"),  # type: ignore[arg-type]
    ]
    for msg, field in bad:
        with pytest.raises(xa.InvalidRequest, match=field):
            device.ask(msg)
    for out, words in [
        (bytearray(4096), "pinned required"),
        (np.zeros(4096, np.uint8), "pinned required"),
        (small, "smaller"),
    ]:
        with pytest.raises(xa.InvalidRequest, match=f"CopyToHost.out: .*{words}"):
            copier.ask(xa.CopyToHost(ref, out=out))
    big = device.ask(xa.AllocatePinned(8192))
    with pytest.raises(xa.InvalidRequest, match="CopyToDevice.data: .*do not fit"):
        copier.ask(xa.CopyToDevice(ref, big))
    big.release()
    with pytest.raises(xa.InvalidRequest, match="CopyToHost.out: .*released"):
        copier.ask(xa.CopyToHost(ref, out=big))
    with pytest.raises(xa.InvalidRequest, match="CopyToDevice.data: .*released"):
        copier.ask(xa.CopyToDevice(ref, big))
    with pytest.raises(xa.InvalidRequest, match="released"):
        big.array()
    # Nothing changed: the same pinned and device figures, the actors alive, the bytes intact.
    after = device.ask(xa.GetStats())
    assert (after.pinned_count, after.pinned_bytes) == (before.pinned_count, before.pinned_bytes) == (1, 1024)
    assert (after.bytes_outstanding, after.live_blocks) == (before.bytes_outstanding, before.live_blocks)
    assert copier.is_alive() and device.is_alive()
    assert copier.ask(xa.CopyToHost(ref)) == b"\x05" * 4096


def test_a_pinned_buffer_of_another_device_is_refused(host_driver: xa.HostDriver) -> None:
    d0 = xa.DeviceActor.start(0, driver=host_driver)
    d1 = xa.DeviceActor.start(1, driver=host_driver)
    try:
        copier = xa.CopyActor.start(d0)
        ref = d0.ask(xa.Allocate(4096))
        other = d1.ask(xa.AllocatePinned(4096))
        assert other.device_ordinal == 1
        with pytest.raises(xa.InvalidRequest, match="CopyToHost.out: .*device 1"):
            copier.ask(xa.CopyToHost(ref, out=other))
        with pytest.raises(xa.InvalidRequest, match="CopyToDevice.data: .*device 1"):
            copier.ask(xa.CopyToDevice(ref, other))
        assert _pinned(d0) == (0, 0) and _pinned(d1) == (1, 4096)
        other.release()
        assert _pinned(d1) == (0, 0)
    finally:
        pykka.ActorRegistry.stop_all()


def test_pinned_accounting_by_tag(device: pykka.ActorRef) -> None:
    a = device.ask(xa.AllocatePinned(3000, tag=xa.AllocTag("batches")))
    b = device.ask(xa.AllocatePinned(5000, tag=xa.AllocTag("batches")))
    c = device.ask(xa.AllocatePinned(100))
    stats = device.ask(xa.GetStats())
    assert (stats.pinned_count, stats.pinned_bytes) == (3, 8100)
    assert stats.pinned_by_tag == {"batches": {"count": 2, "nbytes": 8000}, "untagged": {"count": 1, "nbytes": 100}}
    assert stats.report["pinned"]["nbytes"] == 8100
    report = device.ask(xa.GetReport())
    assert (report.pinned_count, report.pinned_bytes) == (3, 8100)
    assert report.pinned_by_tag[xa.AllocTag("batches")].nbytes == 8000
    assert "pinned host memory: 3 buffers" in report.format()
    assert report.as_dict()["pinned"]["by_tag"]["untagged"]["count"] == 1
    view = a.array()  # a view keeps its memory (and its count) after the release
    for buf in (a, b, c):
        buf.release()
    assert _pinned(device) == (1, 3000)
    del view
    stats = device.ask(xa.GetStats())
    assert (stats.pinned_count, stats.pinned_bytes, stats.pinned_by_tag) == (0, 0, {})
    assert device.ask(xa.GetReport()).pinned_count == 0


def test_pinned_buffers_outlive_a_rebuild(device: pykka.ActorRef) -> None:
    buf = device.ask(xa.AllocatePinned(4096))
    buf.array()[:] = 42
    device.ask(xa.Rebuild("test"))
    assert (buf.array() == 42).all()
    assert _pinned(device) == (1, 4096)
    copier = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(4096))
    copier.ask(xa.CopyToDevice(ref, buf))
    assert copier.ask(xa.CopyToHost(ref)) == b"\x2a" * 4096
    buf.release()
    assert _eventually(lambda: _pinned(device) == (0, 0))


def test_a_host_that_refuses_pinned_memory_gets_out_of_memory(host_driver: xa.HostDriver) -> None:
    device = xa.DeviceActor.start(0, driver=host_driver)
    try:
        host_driver.inject_fault(0, "oom")
        with pytest.raises(xa.OutOfMemory):
            device.ask(xa.AllocatePinned(4096))
        assert _pinned(device) == (0, 0)
        assert device.ask(xa.AllocatePinned(4096)).nbytes == 4096
    finally:
        pykka.ActorRegistry.stop_all()


def test_copy_back_on_the_untracked_direct_stack(driver: xa.Driver) -> None:
    """Without tracking the copy actor synchronizes before it replies: the CopyDone is done."""
    device = xa.DeviceActor.start(0, driver, resource="direct")
    try:
        copier = xa.CopyActor.start(device)
        ref = device.ask(xa.Allocate(4096))
        out = device.ask(xa.AllocatePinned(4096))
        copier.ask(xa.Fill(ref, 0xAB))
        done = copier.ask(xa.CopyToHost(ref, out=out))
        assert done.done()
        done.wait(timeout=0)
        assert (out.array() == 0xAB).all()
    finally:
        pykka.ActorRegistry.stop_all()


def test_a_bad_wait_timeout_is_refused(device: pykka.ActorRef) -> None:
    copier = xa.CopyActor.start(device)
    ref = device.ask(xa.Allocate(64))
    done = copier.ask(xa.CopyToHost(ref, out=device.ask(xa.AllocatePinned(64))))
    for timeout in (-1, "1", True):
        with pytest.raises(xa.InvalidRequest, match="timeout"):
            done.wait(timeout=timeout)  # type: ignore[arg-type]
    done.wait()
    assert done.done()
