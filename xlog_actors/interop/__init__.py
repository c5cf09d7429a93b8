"""Other CUDA libraries allocating through a device: PyTorch (:mod:`xlog_actors.interop.torch`)
and CuPy (:mod:`xlog_actors.interop.cupy`) route their allocations to a ``DeviceActor``, so its
budget, statistics, report and memory history see them under a tag.

The layer above ``actors``: it uses a device's ``DeviceClient``. PyTorch and CuPy are optional
extras (``pip install xlog-actors[torch]``, ``[cupy]``), imported only when a route is set up;
nothing here imports them at import time. The zero-copy exchange of a ``GpuRef`` (DLPack, the
CUDA Array Interface) is another thing, in :mod:`xlog_actors.actors.interop`.

Thread rule: see each module.
"""

from __future__ import annotations

from .allocator import DeviceAllocator, as_client

__all__ = ["DeviceAllocator", "as_client"]
