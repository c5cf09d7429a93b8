"""Landing fetched bytes in a local block: Ray's view of its object store, copied once.

``ray.get`` (and an ``ObjectRef`` resolved as a call's argument) gives a numpy array as a read-only,
zero-copy view of the node's object store, whose objects never change while referenced. A
``CopyToDevice`` of a pageable buffer snapshots it (the caller may reuse a pageable buffer at
once), then copies the snapshot into device memory: two copies. :func:`land` registers such a
view with the host driver for the time of the ask (``HostDriver.register_host``, the
``cuMemHostRegister`` twin), so the ``CopyActor``'s copy reads it when its stream reaches it: one
copy. The queued copy holds the view, and so the object, until then.

Invariants: a buffer is registered only when it is read-only, C-contiguous and non-empty, and the
destination's driver is a ``HostDriver``; anything else is asked as it is, and ``CopyToDevice``
judges it, as it does when the registration is refused. A registration never outlives the ask
(unregistered on every path).

Thread rule: any thread but ``copy``'s own.
"""

from __future__ import annotations

from typing import Any

import pykka

from ..actors import CopyToDevice, GpuRef
from ..driver.host import HostDriver
from ..errors import XlogError

__all__ = ["land", "read_only_view"]


def read_only_view(data: Any) -> memoryview | None:
    """``data`` as a read-only, C-contiguous, non-empty byte view; None when it is not one.

    Args:
        data: anything.
    Returns:
        The byte view, or None (a writable, strided, empty or object buffer, or no buffer).
    Thread rule: any thread.
    """
    try:
        view = memoryview(data)
    except TypeError:
        return None
    if not view.readonly or not view.c_contiguous or view.nbytes == 0 or "O" in view.format:
        return None
    return view.cast("B")


def land(copy: pykka.ActorRef[Any], dst: Any, data: Any, timeout_s: float | None = None) -> None:
    """Ask ``copy`` for ``CopyToDevice(dst, data)``, reading a read-only ``data`` in place.

    Args:
        copy: a ``CopyActor`` of ``dst``'s device.
        dst: the destination handle.
        data: the bytes; a read-only buffer must not change until the copy ran (Ray's never do).
    Raises:
        pykka.Timeout: ``copy`` did not answer within ``timeout_s`` (None: no bound).
        XlogError: what ``CopyToDevice`` raises (nothing is written then).
    Thread rule: any thread but ``copy``'s own.
    """
    view = read_only_view(data)
    driver = dst.context.driver if isinstance(dst, GpuRef) else None
    if view is None or not isinstance(driver, HostDriver):
        copy.ask(CopyToDevice(dst, data), timeout=timeout_s)
        return
    ordinal = dst.context.ordinal
    try:
        key = driver.register_host(ordinal, view)
    except XlogError:
        # Registered already (the same object landed twice at once) or a device that refuses
        # calls: the plain ask copies as before, or reports the device's error as before.
        copy.ask(CopyToDevice(dst, data), timeout=timeout_s)
        return
    try:
        copy.ask(CopyToDevice(dst, view), timeout=timeout_s)
    finally:
        driver.unregister_host(ordinal, key)
