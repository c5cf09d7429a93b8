"""Peer copies: ``cuMemcpyPeerAsync`` from one device's memory to another's.

A peer copy names both devices' contexts: the source's and the destination's primary contexts,
each retained by this driver (the other device's is retained here on its first use, as any call
naming it would). The copy runs on one stream, of either device, under that stream's gate, so a
rebuild of the stream's device either waited for it or refuses it, as with every stream call.

Peer access (``cuCtxEnablePeerAccess``) is not enabled: ``cuMemcpyPeerAsync`` does not need it,
and stages through the host where the two devices cannot reach each other directly. Enabling it
would change every kernel's view of the other device's memory, which is no copy's business.

Thread rule: every method may be called from any thread.
"""

from __future__ import annotations

from typing import Any

from ...errors import DriverError, InvalidRequest
from ..checks import check_nbytes
from .call import SUCCESS, cu
from .context import CudaDevice
from .gates import CudaGates
from .streams import CudaStream

__all__ = ["CudaPeer"]


def _context_of(dev: CudaDevice, *, retain: bool) -> Any:
    """``dev``'s primary context, usable; retained first when ``retain`` (its first use).

    Retain only before the stream's ``_enter``, outside its gate: a first retain makes ``dev``
    current in this thread (the stream's ``_enter`` then makes its own device current again) and
    takes ``dev``'s lock."""
    if dev.poisoned is not None:
        raise dev.poisoned_error()
    if dev.token is None and retain:
        dev.retain()
    ctx = dev.ctx
    if ctx is None or dev.token is None:
        raise DriverError(
            f"device {dev.ordinal}: its context is not retained (the driver is closed)",
            code="CUDA_ERROR_DEINITIALIZED",
        )
    return ctx


class CudaPeer(CudaGates):
    """The peer-copy part of :class:`~xlog_actors.driver.cuda.CudaDriver`.

    Invariant: a peer copy reaches CUDA only with both devices' contexts retained and neither
    poisoned, on a live stream of one of them. Thread rule: any thread.
    """

    def copy_peer(
        self, dst_ordinal: int, dst: int, src_ordinal: int, src: int, nbytes: int, stream: CudaStream
    ) -> None:
        """Enqueue ``cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, nbytes, stream)``.

        Arguments and result: as ``Driver.copy_peer``.
        Raises:
            InvalidRequest: a bad ordinal or ``nbytes``, the same device twice, or ``stream`` of
                neither device (nothing is enqueued).
            DriverError: ``dst`` or ``src`` is no device pointer, or CUDA refused the copy.
            ContextPoisoned: either device saw a sticky error.
            And the stream's errors: see :class:`~.memory.CudaMemory`.
        Thread rule: any thread.
        """
        nbytes = check_nbytes(nbytes, "peer copy size")
        s = self._stream_work(stream, (dst, "peer copy destination"), (src, "peer copy source"))
        dst_dev, src_dev = self._device(dst_ordinal), self._device(src_ordinal)
        if dst_dev is src_dev:
            raise InvalidRequest(
                f"peer copy from device {src_ordinal} to itself: use copy_device_to_device within one device"
            )
        if s._dev is not dst_dev and s._dev is not src_dev:
            raise InvalidRequest(
                f"peer copy {src_ordinal} -> {dst_ordinal}: {s!r} is of device {s.ordinal}, neither of the two"
            )
        other = src_dev if s._dev is dst_dev else dst_dev
        _context_of(other, retain=True)
        with s._gate:
            dev = s._enter()
            dst_ctx, src_ctx = _context_of(dst_dev, retain=False), _context_of(src_dev, retain=False)
            (err,) = cu.cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, nbytes, s._cu)
        if err != SUCCESS:
            dev.fail(
                err,
                f"cuMemcpyPeerAsync({nbytes} bytes, device {src_ordinal} {src:#x} -> device {dst_ordinal} {dst:#x}, "
                f"stream {s._id})",
            )
