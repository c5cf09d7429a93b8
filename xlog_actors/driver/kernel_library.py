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

__all__ = ["AXPY_F32", "FILL_F32", "SCALE_ADD_F32", "SUM_F32", "SUM_F32_MAX_BLOCK", "launch_shape"]

#: The most threads per block :data:`SUM_F32` supports: the size of its shared partial sums.
SUM_F32_MAX_BLOCK = 256


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
    threads = block[0] * block[1] * block[2]
    if threads > SUM_F32_MAX_BLOCK:
        # The GPU kernel would index its shared partial sums past their end.
        raise DriverError(
            f"xlog_sum_f32 with {threads} threads per block writes past its {SUM_F32_MAX_BLOCK} shared "
            "partial sums (an illegal address)",
            code="CUDA_ERROR_ILLEGAL_ADDRESS",
        )
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
