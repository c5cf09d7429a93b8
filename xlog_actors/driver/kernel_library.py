"""The kernels the demo and the benchmarks use, each with CUDA C++ for NVRTC and a host twin.

CUDA code uses ``__fmul_rn``/``__fadd_rn`` so the compiler cannot contract ``a*x+b`` into an FMA:
the GPU then rounds exactly as numpy does and results compare bit for bit with the host
reference. Every kernel takes its element count as its last argument and uses a grid-stride
loop, so any grid covers any size.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .kernel import DeviceMemoryView, Kernel

__all__ = ["AXPY_F32", "FILL_F32", "SCALE_ADD_F32", "SUM_F32", "launch_shape"]


def launch_shape(n: int, block: int = 256, max_blocks: int = 1024) -> tuple[int, int]:
    """``(grid, block)`` for a grid-stride kernel over ``n`` elements."""
    return max(1, min(max_blocks, (n + block - 1) // block)), block


def _fill_host(mem: DeviceMemoryView, _grid: Any, _block: Any, out: int, value: float, n: int) -> None:
    mem.array(out, n, np.float32)[:] = np.float32(value)


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
    np.multiply(src, np.float32(alpha), out=dst)
    np.add(dst, np.float32(beta), out=dst)


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
    ax = np.multiply(mem.array(x, n, np.float32), np.float32(a))
    np.add(ax, ys, out=ys)


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


def _sum_host(mem: DeviceMemoryView, _grid: Any, _block: Any, out: int, x: int, n: int) -> None:
    # Adds into one double, as the GPU kernel's atomicAdd does (zero ``out`` first). The order of
    # additions differs from the GPU's; both are exact for integer-valued data.
    mem.array(out, 1, np.float64)[0] += mem.array(x, n, np.float32).sum(dtype=np.float64)


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
