"""Landing fetched bytes in a local block (``xlog_actors.ray.landing``), without a Ray cluster: a
read-only buffer is registered with the host driver for the ask and read in place, anything else
is asked as it is; bad input changes nothing and leaves no registration behind.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import xlog_actors as xa
from xlog_actors.errors import InvalidRequest
from xlog_actors.ray.landing import land, read_only_view

pytestmark = pytest.mark.timeout(30)
N = 1 << 16


class _Rig:
    def __init__(self) -> None:
        self.driver = xa.HostDriver(memory_per_device=16 << 20)
        self.device = xa.DeviceActor.start(0, self.driver)
        self.copy = xa.CopyActor.start(self.device)
        self.registered: list[int] = []
        register = self.driver.register_host

        def spy(ordinal: int, data: Any) -> int:
            key = register(ordinal, data)
            self.registered.append(key)
            return key

        self.driver.register_host = spy  # type: ignore[method-assign]

    def read(self, ref: xa.GpuRef, nbytes: int) -> bytes:
        data: bytes = self.copy.ask(xa.CopyToHost(ref, nbytes))
        return data

    def close(self) -> None:
        self.copy.stop()
        self.device.stop()
        self.driver.close()


@pytest.fixture
def rig() -> Iterator[_Rig]:
    r = _Rig()
    yield r
    r.close()


def _read_only(data: np.ndarray) -> np.ndarray:
    data.flags.writeable = False
    return data


def test_read_only_view_takes_only_read_only_contiguous_plain_buffers() -> None:
    assert bytes(read_only_view(b"abc") or b"") == b"abc"
    assert read_only_view(_read_only(np.zeros((4, 4), np.float32))).nbytes == 64  # type: ignore[union-attr]
    for bad in [bytearray(b"abc"), np.zeros(4), _read_only(np.zeros((4, 4))[:, ::2]), b"", 42,
                _read_only(np.array([None, 1], dtype=object))]:
        assert read_only_view(bad) is None


def test_a_read_only_buffer_lands_through_a_registration_that_ends_with_the_ask(rig: _Rig) -> None:
    ref = rig.device.ask(xa.Allocate(N))
    data = _read_only(np.arange(N, dtype=np.uint8))
    land(rig.copy, ref, data)
    assert rig.registered == [data.ctypes.data]
    assert rig.read(ref, N) == data.tobytes()
    assert not rig.driver._pinned._registered


def test_a_writable_buffer_is_asked_as_it_is(rig: _Rig) -> None:
    ref = rig.device.ask(xa.Allocate(N))
    data = np.full(N, 4, np.uint8)
    land(rig.copy, ref, data, timeout_s=10)
    assert rig.registered == []
    assert rig.read(ref, N) == data.tobytes()


def test_bad_input_writes_nothing_and_leaves_no_registration(rig: _Rig) -> None:
    ref = rig.device.ask(xa.Allocate(N))
    rig.copy.ask(xa.Fill(ref, 1))
    with pytest.raises(InvalidRequest, match="do not fit"):
        land(rig.copy, ref, _read_only(np.zeros(N + 1, np.uint8)))
    with pytest.raises(InvalidRequest, match="C-contiguous"):
        land(rig.copy, ref, 42)
    assert len(rig.registered) == 1 and not rig.driver._pinned._registered
    assert rig.read(ref, N) == bytes([1]) * N


def test_a_buffer_registered_already_still_lands(rig: _Rig) -> None:
    ref = rig.device.ask(xa.Allocate(N))
    data = _read_only(np.arange(N, dtype=np.uint8))
    key = rig.driver.register_host(0, data)  # held elsewhere: land's own registration is refused
    land(rig.copy, ref, data)
    assert rig.read(ref, N) == data.tobytes()
    rig.driver.unregister_host(0, key)
    assert not rig.driver._pinned._registered
