"""NVRTC: kernel source compiled into cubins, cached per process, and the sleep kernel.

``launch`` compiles ``kernel.source`` with NVRTC (``cuda.bindings.nvrtc``) into a cubin for the
device's architecture, once per process per (kernel, architecture); loading it into a context is
the device's business (``CudaDevice.function``). cuda.core's ``Program`` is not used:
``Kernel.options`` are raw NVRTC flags, which ``ProgramOptions`` cannot take; here compiling is a
single call. ``sleep`` is such a kernel: one thread spinning on ``%globaltimer`` with
``__nanosleep`` (wall-clock microseconds whatever the SM clock).

Thread rule: everything here may be used from any thread; compiles are serialized by one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Final

from ...errors import DriverError
from ..kernel import Kernel
from .call import first_line

__all__ = ["SLEEP_KERNEL", "compile_cubin"]

# The process's cubins by (source, name, arch, options): compiling is 100 ms or more.
_cubins: dict[tuple[str, str, str, tuple[str, ...]], bytes] = {}
_cubin_lock = threading.Lock()


def compile_cubin(source: str, name: str, arch: str, options: Sequence[str] = ()) -> bytes:
    """``source`` compiled by NVRTC into a cubin for ``arch`` (``"sm_90"``), cached per process.

    Args:
        source: CUDA C++ source.
        name: the kernel's (``extern "C"``) name; also the program's file name in messages.
        arch: the target architecture as NVRTC names it (``"sm_90"``).
        options: further raw NVRTC flags.
    Returns:
        The cubin's bytes (the cached object on a repeat call).
    Raises:
        DriverError: naming ``libnvrtc`` when NVRTC cannot be loaded (``.code`` None: it is no
            driver error); with the NVRTC result name and the compile log when the source does
            not compile.
    Thread rule: any thread; compiles of different kernels are serialized (rare).
    """
    key = (source, name, arch, tuple(options))
    cubin = _cubins.get(key)
    if cubin is not None:
        return cubin
    with _cubin_lock:
        cubin = _cubins.get(key)
        if cubin is None:
            cubin = _nvrtc_compile(source, name, arch, tuple(options))
            _cubins[key] = cubin
    return cubin


def _nvrtc_unavailable(exc: BaseException) -> DriverError:
    return DriverError(
        "NVRTC is not available: libnvrtc (libnvrtc.so.13 or .12, from the CUDA toolkit or the "
        "nvidia-cuda-nvrtc wheel) could not be loaded, so kernels (launch, sleep) cannot be "
        f"compiled: {first_line(exc)}",
        code=None,
    )


def _nvrtc_compile(source: str, name: str, arch: str, options: tuple[str, ...]) -> bytes:
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - part of cuda-bindings
        raise _nvrtc_unavailable(exc) from None
    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    try:
        err, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    except Exception as exc:  # noqa: BLE001 - cuda.pathfinder's DynamicLibNotFoundError & co.
        raise _nvrtc_unavailable(exc) from None
    if err != ok:
        raise DriverError(f"nvrtcCreateProgram({name}) failed: {err.name}", code=err.name)
    try:
        opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in options)]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err != ok:
            log = _nvrtc_log(nvrtc, prog)
            raise DriverError(
                f"NVRTC could not compile kernel {name} for {arch}: {err.name}\n{log}", code=err.name
            )
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        if err != ok:
            raise DriverError(f"nvrtcGetCUBINSize({name}) failed: {err.name}", code=err.name)
        cubin: bytes = b" " * size  # size is Any (nvrtc is untyped): name the type
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        if err != ok:
            raise DriverError(f"nvrtcGetCUBIN({name}) failed: {err.name}", code=err.name)
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _nvrtc_log(nvrtc: Any, prog: Any) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or size <= 1:
        return ""
    log: bytes = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    return log.rstrip(b"\0 ").decode(errors="replace")


_SLEEP_SOURCE: Final[str] = r"""
extern "C" __global__ void xlog_sleep_ns(unsigned long long ns) {
    // %globaltimer is wall-clock nanoseconds, so the spin lasts the time asked for whatever
    // the SM clock does (clock64 would stretch with a throttled clock).
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    now = start;
    while (now - start < ns) {
#if __CUDA_ARCH__ >= 700
        __nanosleep(1000);
#endif
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    }
}
"""


def _host_sleep(mem: object, grid: object, block: object, ns: int) -> None:  # pragma: no cover
    import time

    time.sleep(ns / 1e9)


#: The kernel behind ``CudaDriver.sleep`` (one thread; its argument is nanoseconds).
SLEEP_KERNEL: Final[Kernel] = Kernel(
    name="xlog_sleep_ns", source=_SLEEP_SOURCE, params=("u64",), host=_host_sleep
)

