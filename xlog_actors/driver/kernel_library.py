"""The kernels the demo and the benchmarks use, each with CUDA C++ for NVRTC and a host twin.

CUDA code uses ``__fmul_rn``/``__fadd_rn`` so the compiler cannot contract ``a*x+b`` into an FMA:
the GPU then rounds exactly as numpy does and results compare bit for bit with the host
reference. Every kernel takes its element count as its last argument and uses a grid-stride
loop over the x dimension, so any grid covers any size; :func:`launch_shape` picks one.

The public face of this module is :mod:`xlog_actors.kernels`, which documents each kernel.

Thread rule: the kernels are immutable constants and :func:`launch_shape` is pure; any thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import DriverError, InvalidRequest
from .checks import Dim3
from .kernel import DeviceMemoryView, Kernel
from .limits import MAX_THREADS_PER_BLOCK

__all__ = [
    "AXPY_F32",
    "CHECKSUM_U32",
    "CHECKSUM_U32_MAX_BLOCK",
    "FILL_F32",
    "SCALE_ADD_F32",
    "SUM_F32",
    "SCALE_ADD_CHECKSUM_F32",
    "SUM_F32_MAX_BLOCK",
    "checksum_tail",
    "checksum_u32",
    "launch_shape",
]

#: The most threads per block :data:`SUM_F32` supports: the size of its shared partial sums.
SUM_F32_MAX_BLOCK = 256

#: The most threads per block :data:`CHECKSUM_U32` supports: the size of its shared partial sums.
CHECKSUM_U32_MAX_BLOCK = 256


def _positive_int(value: object, what: str, low: int, high: int | None = None) -> int:
    if type(value) is not int or value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise InvalidRequest(f"launch_shape: {what} must be an int {bound}, got {value!r}")
    return value


def launch_shape(n: int, block: int = 256, max_blocks: int = 1024) -> tuple[int, int]:
    """Pick the launch shape of a grid-stride kernel over ``n`` elements.

    One thread per element while that takes at most ``max_blocks`` blocks; beyond, each thread
    loops over several elements. A grid is never empty, so ``n == 0`` gives one block.

    Args:
        n: the element count, a non-negative int.
        block: threads per block, an int in 1..1024.
        max_blocks: the most blocks to use, a positive int.
    Returns:
        ``(grid, block)``: ``grid = max(1, min(max_blocks, ceil(n / block)))``.
    Raises:
        InvalidRequest: an argument out of its range or not an int.
    Thread rule: any thread.
    """
    n = _positive_int(n, "n", 0)
    block = _positive_int(block, "block", 1, MAX_THREADS_PER_BLOCK)
    max_blocks = _positive_int(max_blocks, "max_blocks", 1)
    return max(1, min(max_blocks, (n + block - 1) // block)), block


def _f32(value: float) -> np.float32:
    """``value`` as the float32 CUDA receives: one out of range becomes an infinity, silently."""
    with np.errstate(over="ignore"):
        single: np.float32 = np.float32(value)
    return single


def _fits_shared_partials(name: str, block: Dim3, most: int) -> None:
    """A reduction kernel keeps one shared partial sum per thread: a block of more threads than
    it has partials indexes past their end on the GPU, which the host reports as the illegal
    address it is."""
    threads = block[0] * block[1] * block[2]
    if threads > most:
        raise DriverError(
            f"{name} with {threads} threads per block writes past its {most} shared partial sums "
            "(an illegal address)",
            code="CUDA_ERROR_ILLEGAL_ADDRESS",
        )


def _fill_host(mem: DeviceMemoryView, _grid: Any, _block: Any, out: int, value: float, n: int) -> None:
    mem.array(out, n, np.float32)[:] = _f32(value)


#: ``xlog_fill_f32(float* out, float value, u64 n)``: ``out[i] = value`` for ``i < n``.
FILL_F32 = Kernel(
    name="xlog_fill_f32",
    source=r"""
extern "C" __global__ void xlog_fill_f32(float* out, float value, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        out[i] = value;
    }
}
""",
    params=("ptr", "f32", "u64"),
    host=_fill_host,
)


def _scale_add_host(
    mem: DeviceMemoryView, _grid: Any, _block: Any, out: int, x: int, alpha: float, beta: float, n: int
) -> None:
    src = mem.array(x, n, np.float32)
    dst = mem.array(out, n, np.float32)
    np.multiply(src, _f32(alpha), out=dst)
    np.add(dst, _f32(beta), out=dst)


#: ``xlog_scale_add_f32(float* out, const float* x, float alpha, float beta, u64 n)``:
#: ``out[i] = alpha * x[i] + beta``, rounded twice as numpy rounds it.
SCALE_ADD_F32 = Kernel(
    name="xlog_scale_add_f32",
    source=r"""
extern "C" __global__ void xlog_scale_add_f32(float* out, const float* x, float alpha, float beta,
                                              unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        out[i] = __fadd_rn(__fmul_rn(alpha, x[i]), beta);
    }
}
""",
    params=("ptr", "ptr", "f32", "f32", "u64"),
    host=_scale_add_host,
)


def _axpy_host(mem: DeviceMemoryView, _grid: Any, _block: Any, y: int, x: int, a: float, n: int) -> None:
    ys = mem.array(y, n, np.float32)
    ax = np.multiply(mem.array(x, n, np.float32), _f32(a))
    np.add(ax, ys, out=ys)


#: ``xlog_axpy_f32(float* y, const float* x, float a, u64 n)``: ``y[i] = a * x[i] + y[i]``.
AXPY_F32 = Kernel(
    name="xlog_axpy_f32",
    source=r"""
extern "C" __global__ void xlog_axpy_f32(float* y, const float* x, float a, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        y[i] = __fadd_rn(__fmul_rn(a, x[i]), y[i]);
    }
}
""",
    params=("ptr", "ptr", "f32", "u64"),
    host=_axpy_host,
)


def _sum_host(mem: DeviceMemoryView, _grid: Any, block: Dim3, out: int, x: int, n: int) -> None:
    _fits_shared_partials("xlog_sum_f32", block, SUM_F32_MAX_BLOCK)
    # Adds into one double, as the GPU kernel's atomicAdd does (zero ``out`` first). The order of
    # additions differs from the GPU's; both are exact for integer-valued data.
    mem.array(out, 1, np.float64)[0] += mem.array(x, n, np.float32).sum(dtype=np.float64)


#: ``xlog_sum_f32(double* out, const float* x, u64 n)``: ``*out += sum(x[:n])`` in double
#: (zero ``out`` first); the block must be a power of two of at most :data:`SUM_F32_MAX_BLOCK`
#: threads.
SUM_F32 = Kernel(
    name="xlog_sum_f32",
    source=r"""
extern "C" __global__ void xlog_sum_f32(double* out, const float* x, unsigned long long n) {
    __shared__ double partial[256];
    double acc = 0.0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        acc += (double)x[i];
    }
    partial[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) atomicAdd(out, partial[0]);
}
""",
    params=("ptr", "ptr", "u64"),
    host=_sum_host,
)


#: The two checksum kernels' shared CUDA: a grid-stride loop over ``n`` elements of any grid and
#: block shape, accumulating into ``acc`` (the loop's body is each kernel's own) ...
_SUM_LOOP_HEAD = """    __shared__ unsigned long long partial[256];
    const unsigned int threads = blockDim.x * blockDim.y * blockDim.z;
    const unsigned int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const unsigned long long bid =
        blockIdx.x + (unsigned long long)gridDim.x * (blockIdx.y + (unsigned long long)gridDim.y * blockIdx.z);
    const unsigned long long stride = (unsigned long long)gridDim.x * gridDim.y * gridDim.z * threads;
    unsigned long long acc = 0;
    for (unsigned long long i = bid * threads + tid; i < n; i += stride) {
"""
#: ... then the block's exact reduction of ``acc`` into ``partial[0]`` (at most 256 threads).
_SUM_BLOCK_REDUCE = """    }
    partial[tid] = acc;
    __syncthreads();
    unsigned int width = 1;
    while (width < threads) width <<= 1;
    for (unsigned int s = width >> 1; s > 0; s >>= 1) {
        if (tid < s && tid + s < threads) partial[tid] += partial[tid + s];
        __syncthreads();
    }
"""


def checksum_u32(data: Any) -> int:
    """The host reference of :data:`CHECKSUM_U32`: the sum of ``data``'s 32-bit words modulo 2**64.

    Integer addition wraps and is associative, so this equals the GPU's result exactly whatever
    order its threads and blocks add in.

    Args:
        data: a C-contiguous buffer whose length is a multiple of 4 (bytes, a numpy array).
    Returns:
        The checksum, an int in 0..2**64-1.
    Raises:
        InvalidRequest: ``data``'s length is not a multiple of 4.
    Thread rule: any thread.
    """
    raw = memoryview(data).cast("B")
    if len(raw) % 4:
        raise InvalidRequest(f"checksum_u32: {len(raw)} bytes are not a whole number of 32-bit words")
    return int(np.frombuffer(raw, dtype=np.uint32).sum(dtype=np.uint64))


def _checksum_host(mem: DeviceMemoryView, _grid: Any, block: Dim3, out: int, x: int, n: int) -> None:
    _fits_shared_partials("xlog_checksum_u32", block, CHECKSUM_U32_MAX_BLOCK)
    acc = mem.array(out, 1, np.uint64)
    # Array additions wrap silently modulo 2**64, as the GPU's unsigned atomicAdd does.
    np.add(acc, mem.array(x, n, np.uint32).sum(dtype=np.uint64), out=acc)


#: ``xlog_checksum_u32(u64* out, const u32* x, u64 n)``: ``*out += sum(x[:n])`` modulo 2**64
#: (zero ``out`` first). Exact and independent of the launch shape: any grid, any block of at most
#: :data:`CHECKSUM_U32_MAX_BLOCK` threads in any of its three dimensions.
CHECKSUM_U32 = Kernel(
    name="xlog_checksum_u32",
    source=r"""
extern "C" __global__ void xlog_checksum_u32(unsigned long long* out, const unsigned int* x,
                                             unsigned long long n) {
""" + _SUM_LOOP_HEAD + """        acc += x[i];
""" + _SUM_BLOCK_REDUCE + """    if (tid == 0) atomicAdd(out, partial[0]);
}
""",
    params=("ptr", "ptr", "u64"),
    host=_checksum_host,
)


def checksum_tail(n: int) -> int:
    """Where :data:`SCALE_ADD_CHECKSUM_F32` keeps its checksum: the byte offset, from ``out``, of
    the ``uint64`` after ``n`` float32 elements, rounded up to 8 bytes so the GPU's 64-bit atomic
    is aligned whatever ``n`` is. ``out`` must hold ``checksum_tail(n) + 8`` bytes.

    Args:
        n: the element count, a non-negative int.
    Returns:
        ``(4 * n + 7) // 8 * 8``.
    Raises:
        InvalidRequest: ``n`` is negative or not an int.
    Thread rule: any thread.
    """
    n = _positive_int(n, "n", 0)
    return (4 * n + 7) // 8 * 8


def _scale_add_checksum_host(
    mem: DeviceMemoryView, _grid: Any, block: Dim3, out: int, x: int, alpha: float, beta: float, n: int
) -> None:
    _fits_shared_partials("xlog_scale_add_checksum_f32", block, CHECKSUM_U32_MAX_BLOCK)
    _scale_add_host(mem, _grid, block, out, x, alpha, beta, n)
    acc = mem.array(out + checksum_tail(n), 1, np.uint64)
    # Array additions wrap silently modulo 2**64, as the GPU's unsigned atomicAdd does.
    np.add(acc, mem.array(out, n, np.uint32).sum(dtype=np.uint64), out=acc)


#: ``xlog_scale_add_checksum_f32(float* out, const float* x, float alpha, float beta, u64 n)``:
#: :data:`SCALE_ADD_F32` and :data:`CHECKSUM_U32` of its output in one pass: ``out[i] = alpha *
#: x[i] + beta``, and the ``uint64`` at byte offset :func:`checksum_tail` ``(n)`` of ``out`` gains
#: the sum of the results' 32-bit words modulo 2**64. ``out`` holds ``checksum_tail(n) + 8`` bytes
#: and must not overlap ``x``; the same block limit as :data:`CHECKSUM_U32`.
SCALE_ADD_CHECKSUM_F32 = Kernel(
    name="xlog_scale_add_checksum_f32",
    source=r"""
extern "C" __global__ void xlog_scale_add_checksum_f32(float* out, const float* x, float alpha,
                                                       float beta, unsigned long long n) {
""" + _SUM_LOOP_HEAD + """        const float v = __fadd_rn(__fmul_rn(alpha, x[i]), beta);
        out[i] = v;
        acc += __float_as_uint(v);
""" + _SUM_BLOCK_REDUCE + """    if (tid == 0) {
        unsigned long long* sum = (unsigned long long*)((char*)out + ((4ULL * n + 7ULL) / 8ULL) * 8ULL);
        atomicAdd(sum, partial[0]);
    }
}
""",
    params=("ptr", "ptr", "f32", "f32", "u64"),
    host=_scale_add_checksum_host,
)
