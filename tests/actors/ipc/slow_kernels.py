"""A kernel that is slow on the host driver, for the hazard-ordering test of an isolated device's
library actors: its host implementation must be a module-level function so that the kernel can be
pickled to the device process, which imports this module by name (the test puts this folder on
``sys.path`` before the device process is spawned)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from xlog_actors.driver.kernel import Kernel

#: How long ``SLOW_FILL_U8`` takes on the host driver, in seconds.
SLOW_S = 0.5


def _slow_fill_host(mem: Any, _grid: Any, _block: Any, out: int, byte: int, n: int) -> None:
    time.sleep(SLOW_S)  # a slow kernel, so a reader that does not wait for it reads too early
    mem.array(out, n, np.uint8).fill(byte)


#: ``(out: ptr, byte: u64, n: u64)``: ``out[i] = byte`` for ``n`` bytes, after ``SLOW_S`` on the
#: host driver.
SLOW_FILL_U8 = Kernel(
    name="xlog_test_slow_fill_u8",
    params=("ptr", "u64", "u64"),
    host=_slow_fill_host,
    source=(
        'extern "C" __global__ void xlog_test_slow_fill_u8(unsigned char* out, unsigned long long byte, '
        "unsigned long long n) { for (unsigned long long i = 0; i < n; ++i) out[i] = (unsigned char)byte; }"
    ),
)
