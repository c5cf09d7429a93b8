"""``Driver.copy_peer``: bytes from one device's memory to another's, on a stream of either, and
the typed errors of bad input (which enqueue nothing). Each test runs on the host driver with
two emulated devices and, marked ``gpu``, on the CUDA driver where two GPUs are reachable."""

from __future__ import annotations

import pytest

import xlog_actors as xa

N = 1 << 16



def _filled(driver: xa.Driver, ordinal: int, byte: int) -> tuple[int, xa.Stream]:
    """A pool block of ``N`` bytes on ``ordinal``, filled with ``byte`` (complete), and its stream."""
    stream = driver.create_stream(ordinal)
    ptr = driver.alloc_async(N, stream)
    driver.fill(ptr, byte, N, stream)
    stream.synchronize()
    return ptr, stream


def _read(driver: xa.Driver, ptr: int, stream: xa.Stream, nbytes: int = N) -> bytes:
    out = driver.copy_to_host(ptr, nbytes, stream)
    stream.synchronize()
    return bytes(out)


@pytest.mark.parametrize("on", ["destination", "source"])
def test_bytes_arrive_on_a_stream_of_either_device(two_devices: xa.Driver, on: str) -> None:
    src, s0 = _filled(two_devices, 0, 0x5A)
    dst, s1 = _filled(two_devices, 1, 0)
    stream = s1 if on == "destination" else s0
    two_devices.copy_peer(1, dst, 0, src, N // 2, stream)
    stream.synchronize()
    assert _read(two_devices, dst, s1) == b"\x5a" * (N // 2) + b"\x00" * (N // 2)
    two_devices.copy_peer(0, src, 1, dst, N, stream)  # and back, the other way round
    stream.synchronize()
    assert _read(two_devices, src, s0) == b"\x5a" * (N // 2) + b"\x00" * (N // 2)


def test_an_event_of_the_source_device_orders_the_copy(two_devices: xa.Driver) -> None:
    """The copy is ordered on its stream only; a wait on the source device's event orders it
    after a slow write there (and without the wait it reads the old bytes: the test can fail)."""
    src, s0 = _filled(two_devices, 0, 1)
    dst, s1 = _filled(two_devices, 1, 0)
    other, _ = _filled(two_devices, 1, 0)
    two_devices.sleep(s0, 200_000)
    two_devices.fill(src, 2, N, s0)
    two_devices.copy_peer(1, other, 0, src, N, s1)  # no wait: runs before the slow fill
    s1.wait(s0.record_event())
    two_devices.copy_peer(1, dst, 0, src, N, s1)
    assert _read(two_devices, dst, s1) == b"\x02" * N
    assert _read(two_devices, other, s1) == b"\x01" * N


def test_bad_input_gets_typed_errors_and_enqueues_nothing(two_devices: xa.Driver) -> None:
    src, s0 = _filled(two_devices, 0, 7)
    dst, s1 = _filled(two_devices, 1, 0)
    bad: list[tuple[tuple[object, ...], type[Exception], str]] = [
        ((0, src, 0, src, N, s0), xa.InvalidRequest, "to itself"),
        ((1, dst, 0, src, 0, s1), xa.InvalidRequest, "peer copy size"),
        ((1, dst, 0, src, -1, s1), xa.InvalidRequest, "peer copy size"),
        ((1, dst, 0, src, 1.5, s1), xa.InvalidRequest, "peer copy size"),
        ((1, dst, 0, src, True, s1), xa.InvalidRequest, "peer copy size"),
        ((99, dst, 0, src, N, s1), xa.InvalidRequest, "ordinal"),
        ((1, dst, 0, 0, N, s1), xa.DriverError, "peer copy source"),
        ((1, -5, 0, src, N, s0), xa.DriverError, "peer copy destination"),
        ((1, dst, 0, src, N, "stream"), xa.InvalidRequest, "stream"),
    ]
    for args, error, text in bad:
        with pytest.raises(error, match=text):
            two_devices.copy_peer(*args)  # type: ignore[arg-type]
    assert _read(two_devices, dst, s1) == b"\x00" * N
    two_devices.copy_peer(1, dst, 0, src, N, s1)  # both devices still work
    assert _read(two_devices, dst, s1) == b"\x07" * N


def test_the_host_driver_refuses_ranges_outside_device_memory_and_streams_of_neither_device() -> None:
    driver = xa.HostDriver(device_count=3, memory_per_device=1 << 20)
    try:
        src, s0 = _filled(driver, 0, 3)
        dst, s1 = _filled(driver, 1, 0)
        s2 = driver.create_stream(2)
        with pytest.raises(xa.InvalidRequest, match="neither of the two"):
            driver.copy_peer(1, dst, 0, src, N, s2)
        with pytest.raises(xa.DriverError, match="outside device memory") as info:
            driver.copy_peer(1, src, 0, dst, N, s1)  # each pointer named with the other's device
        assert info.value.code == "CUDA_ERROR_INVALID_VALUE"
        with pytest.raises(xa.DriverError, match="outside device memory"):
            driver.copy_peer(1, dst, 0, src, 2 << 20, s1)
        assert _read(driver, dst, s1) == b"\x00" * N
    finally:
        driver.close()


def test_a_host_peer_copy_is_dropped_when_the_other_device_is_rebuilt_before_it_runs() -> None:
    """The source's memory went with its context: the queued copy is dropped, as a GPU drops
    work of a destroyed context, and neither device is poisoned."""
    driver = xa.HostDriver(device_count=2, memory_per_device=1 << 20)
    try:
        src, _ = _filled(driver, 0, 9)
        dst, s1 = _filled(driver, 1, 4)
        driver.sleep(s1, 200_000)
        driver.copy_peer(1, dst, 0, src, N, s1)
        driver.rebuild_context(0)
        assert _read(driver, dst, s1) == b"\x04" * N
        driver.check_context(0)
        driver.check_context(1)
    finally:
        driver.close()
