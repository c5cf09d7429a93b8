"""Layer above ``actors``: a device as a Ray actor, its generation held cluster-wide (see docs/ray.md).

:func:`start_ray_device` runs a :class:`RayDevice` (a Ray actor hosting a local ``DeviceActor``)
on a node; its allocations travel as :class:`RemoteGpuRef` descriptors, validated against the
(node, ordinal)'s :class:`GenerationKeeper`, a named, detached Ray actor. :func:`fetch`,
:func:`fetch_to` and :func:`fetch_into` move a descriptor's bytes through Ray's object store;
:func:`open_on_node` opens one in place from a process on the device's own node;
a :class:`SlabClient` allocates on the device's node without a Ray call per allocation.

Ray is an optional extra (``pip install 'xlog-actors[ray]'``): nothing here imports it at import
time; the functions that need it raise ``ImportError`` naming the extra.

Thread rule: see each module.
"""

from __future__ import annotations

from .device import RayDevice, start_ray_device
from .fetch import fetch, fetch_into, fetch_to, open_on_node
from .keeper import GenerationKeeper, find_keeper, keeper_handle, keeper_name
from .remote_ref import RemoteGpuRef
from .slab import SlabClient

__all__ = [
    "GenerationKeeper",
    "RayDevice",
    "RemoteGpuRef",
    "SlabClient",
    "fetch",
    "fetch_into",
    "fetch_to",
    "find_keeper",
    "keeper_handle",
    "keeper_name",
    "open_on_node",
    "start_ray_device",
]
