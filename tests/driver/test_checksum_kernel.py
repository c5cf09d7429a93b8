"""``CHECKSUM_U32``: the device-side checksum the demo verifies each batch with. Exact (a sum of
32-bit words modulo 2**64), equal to its host reference ``checksum_u32`` whatever the launch
shape, and bounded like every kernel: a block larger than its shared partial sums poisons the
host device as the illegal address would a GPU."""

from __future__ import annotations

import numpy as np
import pytest

import xlog_actors as xa
from xlog_actors.errors import ContextPoisoned, InvalidRequest
from xlog_actors.kernels import (
    CHECKSUM_U32,
    CHECKSUM_U32_MAX_BLOCK,
    SCALE_ADD_CHECKSUM_F32,
    SCALE_ADD_F32,
    checksum_tail,
    checksum_u32,
    launch_shape,
)


def device_checksum(driver: xa.Driver, data: np.ndarray, grid: object, block: object) -> int:
    """Copy ``data`` to the device, checksum it there with ``grid``/``block``, return the result."""
    stream = driver.create_stream(0)
    x = driver.alloc(0, max(4, data.nbytes))
    out = driver.alloc(0, 8)
    try:
        driver.fill(out, 0, 8, stream)
        if data.nbytes:
            driver.copy_to_device(x, data, stream)
        driver.launch(CHECKSUM_U32, grid, block, [out, x, data.size], stream)
        result = driver.copy_to_host(out, 8, stream)
        stream.synchronize()
        return int(np.frombuffer(result, np.uint64)[0])
    finally:
        stream.synchronize()
        driver.free(0, x)
        driver.free(0, out)
        stream.close()


def words(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32)


@pytest.mark.parametrize(
    ("n", "grid", "block"),
    [(0, 1, 256), (1, 1, 256), (1000, 3, 100), (1 << 16, 7, (16, 4, 2)), (1 << 16, (2, 3, 2), 33),
     (12345, 1024, 256), (100, 1, 1)],
)
def test_the_device_checksum_equals_the_host_reference(driver: xa.Driver, n: int, grid: object, block: object) -> None:
    data = words(n)
    want = checksum_u32(data)
    assert want == sum(int(w) for w in data)  # no wrap at these sizes: the plain sum
    assert device_checksum(driver, data, grid, block) == want


def test_the_checksum_wraps_modulo_2_to_the_64(driver: xa.Driver) -> None:
    # 2**33 words of 0xFFFFFFFF would be needed to wrap by summing: start from a high value instead.
    stream = driver.create_stream(0)
    out, x = driver.alloc(0, 8), driver.alloc(0, 16)
    try:
        driver.copy_to_device(out, np.array([(1 << 64) - 3], np.uint64), stream)
        driver.copy_to_device(x, np.array([1, 2, 3, 4], np.uint32), stream)
        driver.launch(CHECKSUM_U32, 1, 4, [out, x, 4], stream)
        result = driver.copy_to_host(out, 8, stream)
        stream.synchronize()
        assert int(np.frombuffer(result, np.uint64)[0]) == 7
    finally:
        stream.synchronize()
        driver.free(0, x)
        driver.free(0, out)
        stream.close()


def test_a_changed_word_changes_the_checksum(driver: xa.Driver) -> None:
    data = words(4096, seed=2)
    grid, block = launch_shape(data.size)
    before = device_checksum(driver, data, grid, block)
    data[1234] ^= 1
    assert device_checksum(driver, data, grid, block) != before


def test_the_host_reference_takes_any_buffer_of_whole_words() -> None:
    floats = np.arange(8, dtype=np.float32)
    assert checksum_u32(floats) == checksum_u32(floats.tobytes()) == int(floats.view(np.uint32).sum())
    assert checksum_u32(b"") == 0
    with pytest.raises(InvalidRequest, match="32-bit words"):
        checksum_u32(b"abcde")


def test_a_block_larger_than_its_shared_memory_poisons_the_host_device() -> None:
    drv = xa.HostDriver(device_count=1, memory_per_device=1 << 20)
    try:
        s = drv.create_stream(0)
        out, x = drv.alloc(0, 8), drv.alloc(0, 1024)
        drv.fill(out, 0, 8, s)
        drv.fill(x, 1, 1024, s)
        drv.launch(CHECKSUM_U32, 1, CHECKSUM_U32_MAX_BLOCK, [out, x, 256], s)
        s.synchronize()
        drv.launch(CHECKSUM_U32, 1, (CHECKSUM_U32_MAX_BLOCK + 1, 1, 1), [out, x, 256], s)
        with pytest.raises(ContextPoisoned) as info:
            s.synchronize()
        assert info.value.code == "CUDA_ERROR_ILLEGAL_ADDRESS"
    finally:
        drv.close()


def test_reading_past_the_buffer_poisons_the_host_device() -> None:
    drv = xa.HostDriver(device_count=1, memory_per_device=1 << 20)
    try:
        s = drv.create_stream(0)
        out, x = drv.alloc(0, 8), drv.alloc(0, 1024)
        drv.fill(out, 0, 8, s)
        drv.launch(CHECKSUM_U32, 1, 256, [out, x, 257], s)  # 257 words of a 256-word buffer
        with pytest.raises(ContextPoisoned):
            s.synchronize()
    finally:
        drv.close()


def fused(driver: xa.Driver, x: np.ndarray, grid: object, block: object, start: int = 0) -> tuple[np.ndarray, int]:
    """``SCALE_ADD_CHECKSUM_F32`` over ``x`` (alpha 3, beta -0.5) into a buffer whose tail holds
    ``start``: the output elements and the tail after the launch."""
    n = x.size
    tail = checksum_tail(n)
    stream = driver.create_stream(0)
    dx, out = driver.alloc(0, max(4, x.nbytes)), driver.alloc(0, tail + 8)
    try:
        driver.fill(out, 0xAB, tail + 8, stream)  # the padding and the elements: junk until written
        driver.copy_to_device(out + tail, np.array([start], np.uint64), stream)
        if n:
            driver.copy_to_device(dx, x, stream)
        driver.launch(SCALE_ADD_CHECKSUM_F32, grid, block, [out, dx, 3.0, -0.5, n], stream)
        raw = driver.copy_to_host(out, tail + 8, stream)
        stream.synchronize()
        return np.frombuffer(raw, np.float32, count=n).copy(), int(np.frombuffer(raw, np.uint64, offset=tail)[0])
    finally:
        stream.synchronize()
        driver.free(0, dx)
        driver.free(0, out)
        stream.close()


@pytest.mark.parametrize(
    ("n", "grid", "block"), [(0, 1, 256), (1, 1, 256), (7, 2, 3), (4097, 5, (8, 4, 2)), (1 << 16, 1024, 256)]
)
def test_the_fused_kernel_is_scale_add_then_its_checksum(
    driver: xa.Driver, n: int, grid: object, block: object
) -> None:
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    want = np.float32(3.0) * x + np.float32(-0.5)  # numpy rounds the multiply and the add apart
    out, total = fused(driver, x, grid, block)
    assert out.tobytes() == want.tobytes()
    assert total == checksum_u32(want)
    # The same elements as the separate kernel gives, bit for bit.
    stream = driver.create_stream(0)
    dx, dout = driver.alloc(0, max(4, x.nbytes)), driver.alloc(0, max(4, x.nbytes))
    try:
        if n:
            driver.copy_to_device(dx, x, stream)
        driver.launch(SCALE_ADD_F32, grid, block, [dout, dx, 3.0, -0.5, n], stream)
        plain = driver.copy_to_host(dout, x.nbytes, stream) if n else b""
        stream.synchronize()
        assert bytes(plain) == out.tobytes()
    finally:
        stream.synchronize()
        driver.free(0, dx)
        driver.free(0, dout)
        stream.close()


def test_the_fused_checksum_adds_to_the_tail_and_wraps(driver: xa.Driver) -> None:
    x = np.arange(5, dtype=np.float32)
    want = np.float32(3.0) * x + np.float32(-0.5)
    start = (1 << 64) - 1
    _, total = fused(driver, x, 2, 4, start=start)
    assert total == (start + checksum_u32(want)) % (1 << 64)


def test_the_tail_is_aligned_to_8_bytes() -> None:
    assert [checksum_tail(n) for n in (0, 1, 2, 3, 4, 5)] == [0, 8, 8, 16, 16, 24]
    with pytest.raises(InvalidRequest, match="n must be"):
        checksum_tail(-1)


def test_a_fused_launch_past_its_buffer_poisons_the_host_device() -> None:
    drv = xa.HostDriver(device_count=1, memory_per_device=1 << 20)
    try:
        s = drv.create_stream(0)
        x, out = drv.alloc(0, 1024), drv.alloc(0, 1024)  # no room for the tail after 256 elements
        drv.launch(SCALE_ADD_CHECKSUM_F32, 1, 256, [out, x, 1.0, 0.0, 256], s)
        with pytest.raises(ContextPoisoned):
            s.synchronize()
    finally:
        drv.close()
