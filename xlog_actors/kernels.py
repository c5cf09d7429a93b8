"""The kernel library, :class:`Kernel` and :func:`launch_shape`: what a program launches.

Each kernel carries CUDA C++ for NVRTC (compiled once per device architecture on the CUDA driver)
and a numpy twin the host driver runs on the stream's thread, so results compare bit for bit
(the CUDA code rounds each multiply and add on its own, as numpy does). Launch one with
``KernelActor`` (``Launch(kernel, grid, block, args)``, buffers wrapped as ``In``/``Out``/
``InOut``) or ``Driver.launch`` (pointers as ints). Arguments follow the kernel's ``params``:
``"ptr"`` a device pointer, ``"f32"`` a real number, ``"u64"`` a non-negative int; a launch that
does not fit them, or whose grid or block exceeds the device's limits, is refused before it runs,
on both drivers alike.

The kernels, over ``float32`` data of ``n`` elements unless they say otherwise:

``FILL_F32``: ``(out: ptr, value: f32, n: u64)``
    ``out[i] = value``.
``SCALE_ADD_F32``: ``(out: ptr, x: ptr, alpha: f32, beta: f32, n: u64)``
    ``out[i] = alpha * x[i] + beta``; ``out`` may be ``x``.
``SCALE_ADD_CHECKSUM_F32``: ``(out: ptr, x: ptr, alpha: f32, beta: f32, n: u64)``
    ``SCALE_ADD_F32`` and ``CHECKSUM_U32`` of its output in one launch: ``out[i] = alpha * x[i] +
    beta``, and the ``uint64`` at byte offset ``checksum_tail(n)`` of ``out`` (just past the
    elements, rounded up to 8 bytes) gains the checksum of the results. ``out`` holds
    ``checksum_tail(n) + 8`` bytes (zero the tail first) and does not overlap ``x``; at most
    256 threads per block. One buffer then carries a batch's result and its checksum home.
``AXPY_F32``: ``(y: ptr, x: ptr, a: f32, n: u64)``
    ``y[i] = a * x[i] + y[i]``.
``CHECKSUM_U32``: ``(out: ptr, x: ptr, n: u64)``, over ``n`` 32-bit words of any data
    ``*out += sum(x)`` modulo 2**64, where ``out`` is one ``uint64`` (fill it with zeros first):
    an exact checksum whatever the launch shape, so a batch can be verified on the device and only
    8 bytes come back. ``checksum_u32(data)`` is its host reference. At most
    :data:`CHECKSUM_U32_MAX_BLOCK` (256) threads per block, of any shape.
``SUM_F32``: ``(out: ptr, x: ptr, n: u64)``
    ``*out += sum(x)``, where ``out`` is one ``float64`` (fill it with zeros first). Its block
    must be a power of two of at most :data:`SUM_F32_MAX_BLOCK` (256) threads, as
    ``launch_shape``'s default is; a larger block overruns its shared memory, which the host
    driver reports as the illegal address a GPU would.

The launch shape rule: every kernel loops over its elements with a grid-stride loop along x, so
any grid covers any ``n``; ``launch_shape(n)`` returns ``(grid, block)`` with ``block = 256``
and ``grid = max(1, min(1024, ceil(n / 256)))``. Each buffer must hold the ``n`` elements the
kernel touches: on the host driver, an access outside the buffer poisons the device with
``ContextPoisoned`` (``CUDA_ERROR_ILLEGAL_ADDRESS``), as compute-sanitizer would report it.

Example::

    grid, block = launch_shape(n)
    kernels.ask(Launch(SCALE_ADD_F32, grid, block, [Out(out), In(x), 2.0, 1.0, n]))

Thread rule: the kernels are immutable and ``launch_shape`` is pure; any thread may use them.
"""

from __future__ import annotations

from .driver.kernel import PARAM_DTYPES, DeviceMemoryView, Kernel, ParamKind
from .driver.kernel_library import (
    AXPY_F32,
    CHECKSUM_U32,
    CHECKSUM_U32_MAX_BLOCK,
    FILL_F32,
    SCALE_ADD_CHECKSUM_F32,
    SCALE_ADD_F32,
    SUM_F32,
    SUM_F32_MAX_BLOCK,
    checksum_tail,
    checksum_u32,
    launch_shape,
)

__all__ = [
    "AXPY_F32",
    "CHECKSUM_U32",
    "CHECKSUM_U32_MAX_BLOCK",
    "FILL_F32",
    "PARAM_DTYPES",
    "SCALE_ADD_CHECKSUM_F32",
    "SCALE_ADD_F32",
    "SUM_F32",
    "SUM_F32_MAX_BLOCK",
    "DeviceMemoryView",
    "Kernel",
    "ParamKind",
    "checksum_tail",
    "checksum_u32",
    "launch_shape",
]
