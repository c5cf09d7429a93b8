"""The CUDA driver: the driver protocol on ``cuda.bindings.driver`` (cuda-python).

:class:`CudaDriver` is the facade; :mod:`.driver` says what it is made of. Importing this package
imports cuda-python but never calls libcuda: that waits for ``CudaDriver()``.
"""

from __future__ import annotations

from .call import CONTEXT_LOST_CODES, OOM_CODES, STICKY_CODES, check, error_class_for, error_for, result_name
from .driver import CudaDriver
from .nvrtc import SLEEP_KERNEL, compile_cubin
from .streams import CudaEvent, CudaStream

__all__ = [
    "CONTEXT_LOST_CODES",
    "OOM_CODES",
    "SLEEP_KERNEL",
    "STICKY_CODES",
    "CudaDriver",
    "CudaEvent",
    "CudaStream",
    "check",
    "compile_cubin",
    "error_class_for",
    "error_for",
    "result_name",
]
