"""The GIL-keeping driver calls (``driver/cuda/held.py``) marshal their arguments and results as
the driver API declares them: checked here against a stub library of the same signatures that
records what it received (the real calls run in the GPU tests of ``test_cuda_driver.py``)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from xlog_actors.driver.cuda.held import HELD_ENTRY_POINTS, HeldCalls

_STUB = r"""
typedef unsigned long long u64;
u64 last[12];
static void keep(int n, u64 *v) { for (int i = 0; i < 12; i++) last[i] = i < n ? v[i] : 0; }
int htod(u64 dst, void *src, unsigned long n, void *s) {
    u64 v[] = {1, dst, (u64)src, n, (u64)s}; keep(5, v); return 0;
}
int dtoh(void *dst, u64 src, unsigned long n, void *s) {
    u64 v[] = {2, (u64)dst, src, n, (u64)s}; keep(5, v); return 0;
}
int dtod(u64 dst, u64 src, unsigned long n, void *s) { u64 v[] = {3, dst, src, n, (u64)s}; keep(5, v); return 0; }
int record(void *e, void *s) { u64 v[] = {4, (u64)e, (u64)s}; keep(3, v); return 0; }
int query(void *e) { u64 v[] = {5, (u64)e}; keep(2, v); return e == (void *)0x600 ? 600 : 0; }
int create(void **out, unsigned flags) { u64 v[] = {6, flags}; keep(2, v); *out = (void *)0xE7E7; return 0; }
int wait_event(void *s, void *e, unsigned flags) { u64 v[] = {7, (u64)s, (u64)e, flags}; keep(4, v); return 0; }
int state(int dev, unsigned *flags, int *active) {
    u64 v[] = {8, (u64)dev}; keep(2, v); *flags = 0; *active = dev == 3; return 0;
}
int launch(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
           unsigned shared, void *s, void *params, void *extra) {
    u64 v[] = {9, (u64)f, gx, gy, gz, bx, by, bz, shared, (u64)s, (u64)params, (u64)extra}; keep(12, v); return 0;
}
int graph_launch(void *exec, void *s) { u64 v[] = {10, (u64)exec, (u64)s}; keep(3, v); return 0; }
int memcpy_set(void *exec, void *node, void *params, void *ctx) {
    u64 v[] = {11, (u64)exec, (u64)node, (u64)params, (u64)ctx}; keep(5, v); return 0;
}
int kernel_set(void *exec, void *node, void *params) {
    u64 v[] = {13, (u64)exec, (u64)node, (u64)params}; keep(4, v); return 0;
}
int memset_d8(u64 dst, unsigned char byte, unsigned long n, void *s) {
    u64 v[] = {12, dst, byte, n, (u64)s}; keep(5, v); return 0;
}
"""

_NAMES = {"cuMemcpyHtoDAsync": "htod", "cuMemcpyDtoHAsync": "dtoh", "cuMemcpyDtoDAsync": "dtod",
          "cuEventRecord": "record", "cuEventQuery": "query", "cuEventCreate": "create",
          "cuStreamWaitEvent": "wait_event", "cuDevicePrimaryCtxGetState": "state", "cuLaunchKernel": "launch",
          "cuGraphLaunch": "graph_launch", "cuGraphExecMemcpyNodeSetParams": "memcpy_set",
          "cuGraphExecKernelNodeSetParams": "kernel_set",
          "cuMemsetD8Async": "memset_d8"}


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> tuple[HeldCalls, ctypes.Array[ctypes.c_uint64]]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stub library")
    folder = Path(tmp_path_factory.mktemp("held"))
    (folder / "stub.c").write_text(_STUB)
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(folder / "stub.so"), str(folder / "stub.c")], check=True)
    lib = ctypes.CDLL(str(folder / "stub.so"))
    assert set(_NAMES) == set(HELD_ENTRY_POINTS), "a held call without a stub, or the reverse"
    entry = {name: int(ctypes.cast(getattr(lib, fn), ctypes.c_void_p).value or 0) for name, fn in _NAMES.items()}
    return HeldCalls(entry), (ctypes.c_uint64 * 12).in_dll(lib, "last")


def test_each_call_passes_its_arguments_and_returns_the_code(
    stub: tuple[HeldCalls, ctypes.Array[ctypes.c_uint64]],
) -> None:
    held, last = stub
    big = 0x7F00_0000_1000  # device pointers above 2**32 must arrive whole
    assert held.memcpy_htod(big, 0x5000, 1 << 24, 0x77) == 0 and list(last[:5]) == [1, big, 0x5000, 1 << 24, 0x77]
    assert held.memcpy_dtoh(0x5000, big, 64, 0x78) == 0 and list(last[:5]) == [2, 0x5000, big, 64, 0x78]
    assert held.memcpy_dtod(big, big + 64, 8, None) == 0 and list(last[:5]) == [3, big, big + 64, 8, 0]
    assert held.event_record(0xE1, 0x77) == 0 and list(last[:3]) == [4, 0xE1, 0x77]
    assert held.event_query(0xE1) == 0 and held.event_query(0x600) == 600, "a failure code comes back as is"
    assert held.new_event(2) == (0, 0xE7E7) and list(last[:2]) == [6, 2]
    assert held.stream_wait(0x77, 0xE1, 0) == 0 and list(last[:4]) == [7, 0x77, 0xE1, 0]
    assert held.graph_launch(0xEE, 0x77) == 0 and list(last[:3]) == [10, 0xEE, 0x77]
    assert held.graph_memcpy_set(0xEE, 0xD0, 0x9000, 0xC7) == 0 and list(last[:5]) == [11, 0xEE, 0xD0, 0x9000, 0xC7]
    assert held.graph_kernel_set(0xEE, 0xD1, 0x9100) == 0 and list(last[:4]) == [13, 0xEE, 0xD1, 0x9100]
    assert held.memset_d8(big, 0xAB, 1 << 20, 0x77) == 0 and list(last[:5]) == [12, big, 0xAB, 1 << 20, 0x77]
    assert held.primary_active(3) == (0, True) and held.primary_active(0) == (0, False)
    assert held.launch(0xF0, 2, 1, 1, 256, 1, 1, 0, 0x77, 0xA000, None) == 0
    assert list(last) == [9, 0xF0, 2, 1, 1, 256, 1, 1, 0, 0x77, 0xA000, 0]
