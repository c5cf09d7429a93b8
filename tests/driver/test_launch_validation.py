"""The host driver refuses exactly the launches CUDA refuses, with the same error and code.

The same lists run on both drivers (the ``driver`` fixture: host everywhere, cuda on a GPU): bad
launches must raise the same error type with the same ``code`` (``cuLaunchKernel``'s
``CUDA_ERROR_INVALID_VALUE`` for a dimension out of the device's limits, ``InvalidRequest`` for
what cannot even be packed), and good launches at the limits must run and compute. A refused
launch leaves the stream usable and nothing enqueued. Out-of-bounds kernels are host-only (they
would poison the GPU process): see ``test_host_kernel_bounds.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import xlog_actors as xa
from xlog_actors.errors import DriverError, InvalidRequest
from xlog_actors.kernels import FILL_F32

N = 256  # floats each good launch fills
NBYTES = 4 * N

# One parameter of every kind; the first thread writes ``a`` (an i32) so the launch is observable.
_KINDS_SOURCE = r"""
extern "C" __global__ void xlog_test_param_kinds(float* out, int a, unsigned int b, long long c,
                                                 unsigned long long d, float e, double f) {
    if (blockIdx.x == 0 && threadIdx.x == 0) out[0] = (float)a;
}
"""


def _kinds_host(mem: Any, grid: Any, block: Any, out: int, a: int, *rest: object) -> None:
    mem.array(out, 1, np.float32)[0] = np.float32(a)


KINDS = xa.Kernel(
    name="xlog_test_param_kinds",
    source=_KINDS_SOURCE,
    params=("ptr", "i32", "u32", "i64", "u64", "f32", "f64"),
    host=_kinds_host,
)

Args = Callable[[int], list[object]]


def fill(value: object = 1.0, n: object = N) -> Args:
    return lambda ptr: [ptr, value, n]


def kinds(**overrides: object) -> Args:
    base = {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5.0, "f": 6.0}
    base.update(overrides)
    return lambda ptr: [ptr, *base.values()]


INVALID_VALUE = (DriverError, "CUDA_ERROR_INVALID_VALUE")
REFUSED = (InvalidRequest, None)

# (id, kernel, grid, block, args, (error type, code))
BAD: list[tuple[str, xa.Kernel, Any, Any, Args, tuple[type[Exception], str | None]]] = [
    # dimensions cuLaunchKernel refuses
    ("grid-0", FILL_F32, 0, 1, fill(), INVALID_VALUE),
    ("block-0", FILL_F32, 1, 0, fill(), INVALID_VALUE),
    ("grid-y-0", FILL_F32, (1, 0, 1), 1, fill(), INVALID_VALUE),
    ("grid-negative", FILL_F32, -1, 1, fill(), INVALID_VALUE),
    ("block-negative", FILL_F32, 1, (-4, 1), fill(), INVALID_VALUE),
    ("block-1025", FILL_F32, 1, 1025, fill(), INVALID_VALUE),
    ("block-2048", FILL_F32, 1, 2048, fill(), INVALID_VALUE),
    ("block-32x32x2", FILL_F32, 1, (32, 32, 2), fill(), INVALID_VALUE),
    ("block-y-1025", FILL_F32, 1, (1, 1025), fill(), INVALID_VALUE),
    ("block-z-65", FILL_F32, 1, (1, 1, 65), fill(), INVALID_VALUE),
    ("block-z-128", FILL_F32, 1, (1, 1, 128), fill(), INVALID_VALUE),
    ("grid-x-2^31", FILL_F32, 1 << 31, 1, fill(), INVALID_VALUE),
    ("grid-y-65536", FILL_F32, (1, 65536), 1, fill(), INVALID_VALUE),
    ("grid-z-70000", FILL_F32, (1, 1, 70000), 1, fill(), INVALID_VALUE),
    # shapes that are not 1 to 3 ints
    ("grid-float", FILL_F32, 1.5, 1, fill(), REFUSED),
    ("block-float", FILL_F32, 1, 256.0, fill(), REFUSED),
    ("grid-bool", FILL_F32, True, 1, fill(), REFUSED),
    ("grid-none", FILL_F32, None, 1, fill(), REFUSED),
    ("grid-str", FILL_F32, "1", 1, fill(), REFUSED),
    ("grid-empty", FILL_F32, (), 1, fill(), REFUSED),
    ("block-4d", FILL_F32, 1, (1, 1, 1, 1), fill(), REFUSED),
    ("block-float-in-tuple", FILL_F32, 1, (32, 2.0), fill(), REFUSED),
    # arguments that do not fit their parameter
    ("too-few-args", FILL_F32, 1, 1, lambda p: [p, 1.0], REFUSED),
    ("too-many-args", FILL_F32, 1, 1, lambda p: [p, 1.0, N, 0], REFUSED),
    ("float-for-u64", FILL_F32, 1, 1, fill(n=256.0), REFUSED),
    ("bool-for-u64", FILL_F32, 1, 1, fill(n=True), REFUSED),
    ("negative-u64", FILL_F32, 1, 1, fill(n=-1), REFUSED),
    ("u64-2^64", FILL_F32, 1, 1, fill(n=1 << 64), REFUSED),
    ("bool-for-f32", FILL_F32, 1, 1, fill(value=True), REFUSED),
    ("str-for-f32", FILL_F32, 1, 1, fill(value="1.0"), REFUSED),
    ("int-too-large-for-f32", FILL_F32, 1, 1, fill(value=10**400), REFUSED),
    ("float-for-ptr", FILL_F32, 1, 1, lambda p: [float(p), 1.0, N], REFUSED),
    ("none-for-ptr", FILL_F32, 1, 1, lambda p: [None, 1.0, N], REFUSED),
    ("negative-ptr", FILL_F32, 1, 1, lambda p: [-1, 1.0, N], REFUSED),
    ("ptr-2^64", FILL_F32, 1, 1, lambda p: [1 << 64, 1.0, N], REFUSED),
    ("i32-2^31", KINDS, 1, 1, kinds(a=1 << 31), REFUSED),
    ("i32-below-min", KINDS, 1, 1, kinds(a=-(1 << 31) - 1), REFUSED),
    ("np-float-for-i32", KINDS, 1, 1, kinds(a=np.float64(1.0)), REFUSED),
    ("u32-negative", KINDS, 1, 1, kinds(b=-1), REFUSED),
    ("u32-2^32", KINDS, 1, 1, kinds(b=1 << 32), REFUSED),
    ("np-bool-for-u32", KINDS, 1, 1, kinds(b=np.bool_(True)), REFUSED),
    ("i64-2^63", KINDS, 1, 1, kinds(c=1 << 63), REFUSED),
    ("float-for-i64", KINDS, 1, 1, kinds(c=1.5), REFUSED),
    ("np-uint64-above-i64", KINDS, 1, 1, kinds(c=np.uint64(1 << 63)), REFUSED),
    ("bool-for-f64", KINDS, 1, 1, kinds(f=False), REFUSED),
]

# (id, kernel, grid, block, args, the first float the launch leaves in the buffer)
GOOD: list[tuple[str, xa.Kernel, Any, Any, Args, float]] = [
    ("one-thread", FILL_F32, 1, 1, fill(2.0), 2.0),
    ("block-1024", FILL_F32, 1, 1024, fill(3.0), 3.0),
    ("block-32x32", FILL_F32, 2, (32, 32), fill(4.0), 4.0),
    ("block-16x16x4", FILL_F32, 1, (16, 16, 4), fill(4.5), 4.5),
    ("block-z-64", FILL_F32, 1, (1, 1, 64), fill(5.0), 5.0),
    ("grid-y-65535", FILL_F32, (1, 65535), 1, fill(6.0), 6.0),
    ("grid-x-65536", FILL_F32, 65536, 1, fill(7.0), 7.0),
    ("list-and-numpy-dims", FILL_F32, [np.int64(2), 1], [np.int32(128)], fill(8.0), 8.0),
    ("numpy-scalar-args", FILL_F32, 1, 256, fill(np.float32(9.5), np.uint64(N)), 9.5),
    ("int-for-f32", FILL_F32, 1, 256, fill(7), 7.0),
    ("f32-overflows-to-inf", FILL_F32, 1, 256, fill(1e300), float("inf")),
    ("kinds-at-minimum", KINDS, 1, 1, kinds(a=-(1 << 31), b=0, c=-(1 << 63), d=0), float(-(1 << 31))),
    (
        "kinds-at-maximum",
        KINDS, 1, 1, kinds(a=(1 << 31) - 1, b=(1 << 32) - 1, c=(1 << 63) - 1, d=(1 << 64) - 1), float(1 << 31),
    ),
    ("kinds-numpy-ints", KINDS, 1, 1, kinds(a=np.int32(-5), b=np.uint8(7), c=np.int64(1), d=np.uint64(2)), -5.0),
]


@pytest.fixture
def stream_and_buffer(driver: xa.Driver) -> Iterator[tuple[xa.Stream, int]]:
    """A stream and a buffer of ``NBYTES`` zeroed bytes on device 0, freed after the test."""
    stream = driver.create_stream(0)
    ptr = driver.alloc(0, NBYTES)
    driver.fill(ptr, 0, NBYTES, stream)
    stream.synchronize()
    yield stream, ptr
    stream.synchronize()
    driver.free(0, ptr)
    stream.close()


def _first_float(driver: xa.Driver, ptr: int, stream: xa.Stream) -> float:
    out = driver.copy_to_host(ptr, NBYTES, stream)
    stream.synchronize()
    return float(np.frombuffer(out, np.float32)[0])


@pytest.mark.parametrize(("kernel", "grid", "block", "args", "expected"), [pytest.param(*c[1:], id=c[0]) for c in BAD])
def test_a_bad_launch_gets_the_same_error_on_every_driver(
    driver: xa.Driver,
    stream_and_buffer: tuple[xa.Stream, int],
    kernel: xa.Kernel,
    grid: Any,
    block: Any,
    args: Args,
    expected: tuple[type[Exception], str | None],
) -> None:
    stream, ptr = stream_and_buffer
    error, code = expected
    with pytest.raises(error) as info:
        driver.launch(kernel, grid, block, args(ptr), stream)
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"  # not a subclass
    assert getattr(info.value, "code", None) == code
    # Nothing was enqueued, and the stream and the buffer are as they were.
    assert stream.query()
    driver.launch(FILL_F32, 1, 256, [ptr, 1.0, N], stream)
    assert _first_float(driver, ptr, stream) == 1.0


@pytest.mark.parametrize(("kernel", "grid", "block", "args", "first"), [pytest.param(*c[1:], id=c[0]) for c in GOOD])
def test_a_good_launch_runs_on_every_driver(
    driver: xa.Driver,
    stream_and_buffer: tuple[xa.Stream, int],
    kernel: xa.Kernel,
    grid: Any,
    block: Any,
    args: Args,
    first: float,
) -> None:
    stream, ptr = stream_and_buffer
    with np.errstate(over="ignore"):  # 1e300 packs as an f32 infinity, as CUDA receives it
        driver.launch(kernel, grid, block, args(ptr), stream)
    assert _first_float(driver, ptr, stream) == first


def test_a_kernel_that_touches_nothing_is_not_refused_whatever_its_pointer(
    driver: xa.Driver, stream_and_buffer: tuple[xa.Stream, int]
) -> None:
    """CUDA does not look at a pointer before the kernel runs, and a kernel over no element reads
    none: a pointer to nothing with n = 0 neither raises nor poisons."""
    stream, ptr = stream_and_buffer
    driver.launch(FILL_F32, 1, 256, [16, 1.0, 0], stream)
    stream.synchronize()
    driver.launch(FILL_F32, 1, 256, [ptr, 2.0, N], stream)
    assert _first_float(driver, ptr, stream) == 2.0


def test_argument_errors_name_the_index_kind_and_value(
    driver: xa.Driver, stream_and_buffer: tuple[xa.Stream, int]
) -> None:
    stream, ptr = stream_and_buffer
    with pytest.raises(InvalidRequest) as info:
        driver.launch(FILL_F32, 1, 1, [ptr, 1.0, 2.5], stream)
    assert "argument 2" in str(info.value) and "u64" in str(info.value) and "2.5" in str(info.value)


def _three(dims: Any) -> tuple[int, int, int]:
    values = [dims] if isinstance(dims, int) else list(dims)
    return tuple(values + [1] * (3 - len(values)))  # type: ignore[return-value]


# The dimension cases the shared check refuses as CUDA_ERROR_INVALID_VALUE (the negative ones cannot
# even be passed to cuLaunchKernel's unsigned parameters).
RAW_DIMENSIONS = [
    pytest.param(case[2], case[3], id=case[0])
    for case in BAD
    if case[5] is INVALID_VALUE and not case[0].endswith("negative")
]


@pytest.mark.gpu
@pytest.mark.parametrize(("grid", "block"), RAW_DIMENSIONS)
def test_cuda_itself_refuses_each_dimension_the_shared_check_refuses(grid: Any, block: Any) -> None:
    """Both drivers refuse these launches in the shared check, before ``cuLaunchKernel``; here
    ``cuLaunchKernel`` is called past the check with the same dimensions, to show that the real
    device returns ``CUDA_ERROR_INVALID_VALUE`` for each: the host emulation mirrors the device,
    not a guess of it. The kernel covers no element (n = 0), so a launch CUDA took would do
    nothing, and the assertion would name it."""
    from cuda.bindings import driver as cu

    from xlog_actors.driver.cuda.driver import _pack_args

    drv = xa.open_driver("cuda")
    try:
        stream = drv.create_stream(0)
        ptr = drv.alloc(0, NBYTES)
        fn = stream._enter().function(FILL_F32)
        slots, params = _pack_args(FILL_F32, [ptr, 1.0, 0])
        g, b = _three(grid), _three(block)
        (err,) = cu.cuLaunchKernel(fn, *g, *b, 0, stream._cu, params, 0)
        del slots
        stream.synchronize()
        drv.free(0, ptr)
        assert err == cu.CUresult.CUDA_ERROR_INVALID_VALUE, f"grid {g}, block {b}: cuLaunchKernel returned {err}"
    finally:
        drv.close()
