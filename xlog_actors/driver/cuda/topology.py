"""Where a CUDA device sits on the host: the CPUs of the NUMA node its PCI link hangs from.

Why: pinned host memory lands on the NUMA node of the CPU that first touches it, and a copy
between a GPU and host memory on the other node crosses the inter-socket link. On a host of two
nodes with a GPU on each, a process that runs (and pins) on the wrong node moved half the
bandwidth of one on the right node, from run to run as the scheduler placed it. A process that
drives one device binds itself to that device's CPUs before it allocates anything.

The device's node comes from its PCI bus id (``cuDeviceGetPCIBusId``, no context needed) and
sysfs (``/sys/bus/pci/devices/<id>/local_cpulist``). Where either is missing (no GPU, no sysfs,
a single-node host whose list is every CPU) the answer is None and nothing is bound.

Thread rule: any thread; :func:`bind_to_device` binds the calling thread (and the threads it
starts afterwards, which inherit its CPUs).
"""

from __future__ import annotations

import os
from pathlib import Path

from .call import SUCCESS, cu

__all__ = ["bind_to_device", "local_cpus", "parse_cpulist", "sysfs_name"]

_SYSFS = Path("/sys/bus/pci/devices")


def parse_cpulist(text: str) -> frozenset[int]:
    """The CPUs of a kernel CPU list (``"0-15,32-47"``).

    Raises:
        ValueError: not such a list.
    Thread rule: any thread.
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        first, last = int(low), int(high) if high else int(low)
        if first < 0 or last < first:
            raise ValueError(f"not a CPU list: {text!r}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def sysfs_name(bus_id: str) -> str:
    """A PCI bus id as CUDA gives it (``"0000:1B:00.0"``, or with an 8-digit domain) as sysfs
    names the device (``"0000:1b:00.0"``).

    Raises:
        ValueError: not a bus id.
    Thread rule: any thread.
    """
    parts = bus_id.strip().strip("\x00").split(":")
    if len(parts) != 3 or "." not in parts[2]:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    return f"{int(parts[0], 16):04x}:{parts[1].lower()}:{parts[2].lower()}"


def local_cpus(ordinal: int) -> frozenset[int] | None:
    """The CPUs of device ``ordinal``'s NUMA node that this process may run on, or None when
    they cannot be told or are all of them (nothing to gain from a binding).
    Thread rule: any thread.
    """
    if cu is None:
        return None
    try:
        (err,) = cu.cuInit(0)
        if err != SUCCESS:
            return None
        err, dev = cu.cuDeviceGet(ordinal)
        if err != SUCCESS:
            return None
        err, raw = cu.cuDeviceGetPCIBusId(16, dev)
        if err != SUCCESS:
            return None
        bus_id = raw.decode() if isinstance(raw, bytes) else str(raw)
        cpus = parse_cpulist((_SYSFS / sysfs_name(bus_id) / "local_cpulist").read_text())
    except (OSError, ValueError):
        return None
    allowed = frozenset(os.sched_getaffinity(0))
    mine = cpus & allowed
    return mine if mine and mine != allowed else None


def bind_to_device(ordinal: int) -> frozenset[int] | None:
    """Run the calling thread (and the threads it starts from now on) on device ``ordinal``'s
    CPUs (:func:`local_cpus`).

    Returns:
        the CPUs bound to, or None when nothing was bound.
    Thread rule: any thread, for itself.
    """
    cpus = local_cpus(ordinal)
    if cpus is None:
        return None
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        return None
    return cpus
