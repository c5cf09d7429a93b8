"""``DeviceContext``: one generation of a device's context, as actors and handles see it.

The class lives in :mod:`.gpu_ref`, beside the ``GpuRef`` it makes: the two types refer to each
other, and one module keeps them out of an import circle. This module keeps its import path.
"""

from __future__ import annotations

from .gpu_ref import RECLAIM_BATCH, RECLAIM_WAKE_BYTES, DeviceContext

__all__ = ["RECLAIM_BATCH", "RECLAIM_WAKE_BYTES", "DeviceContext"]
