"""``DirectCudaResource``: one synchronous driver allocation per call, the sanitizer backend."""

from __future__ import annotations

import threading

from ..driver.checks import check_device, check_nbytes, unknown_block
from ..driver.limits import ALIGNMENT
from ..driver.protocol import Driver
from ..errors import DriverError
from .block import AllocTag, DeviceBlock, Generation, StreamId, make_block
from .device_bound import DeviceBound
from .resource import DeviceMemoryResource

__all__ = ["DirectCudaResource"]


class DirectCudaResource(DeviceBound, DeviceMemoryResource):
    """``cuMemAlloc``/``cuMemFree`` per call: no pool, no suballocation, so Compute Sanitizer
    sees every allocation's true bounds.

    The ``stream`` given to ``allocate`` is recorded on the block but binds nothing: the free is
    ``cuMemFree``, which synchronizes the device first. Cross-stream tracking is not offered (the
    hooks raise ``StreamMisuse``): code that needs it runs on ``AsyncCudaResource``.

    Thread rule: every method may be called from any thread at any time. One lock guards the
    live map and the byte counter; the driver is called outside it.
    """

    __slots__ = ("_bytes", "_live", "_lock")

    def __init__(self, driver: Driver, ordinal: int) -> None:
        """An empty resource on device ``ordinal`` of ``driver``.

        Args:
            driver: the driver that owns the device.
            ordinal: the device's ordinal (checked by the driver on the first allocation).
        Thread rule: any thread.
        """
        super().__init__(driver, ordinal)
        self._lock = threading.Lock()
        self._live: dict[int, DeviceBlock] = {}
        self._bytes = 0

    def allocate(
        self, nbytes: int, stream: StreamId = StreamId.DEFAULT, tag: AllocTag = AllocTag.UNTAGGED
    ) -> DeviceBlock:
        """Allocate ``nbytes`` synchronously.

        Args:
            nbytes: a positive ``int``.
            stream: recorded on the block; orders nothing.
            tag: what the allocation is for.
        Returns:
            A live block aligned to 256 bytes, with a new generation.
        Raises:
            InvalidRequest: ``nbytes`` is not a positive ``int``, or the ordinal is not a device
                of the driver.
            OutOfMemory: the driver cannot satisfy the request.
            DriverError: the driver failed, or handed out a pointer already live (then the new
                allocation was given back and the map is as it was).
        Thread rule: any thread; the driver call runs outside the lock.
        """
        nbytes = check_nbytes(nbytes)
        ptr = self._driver.alloc(self._ordinal, nbytes)
        block = make_block(ptr, self._ordinal, stream, nbytes, ALIGNMENT, tag, Generation.next())
        with self._lock:
            collision = ptr in self._live
            if not collision:
                self._live[ptr] = block
                self._bytes += nbytes
        if collision:
            # The driver handed out an address we believe is live: our map or the driver is
            # wrong. Give the new allocation back and leave the map as it was.
            self._driver.free(self._ordinal, ptr)
            raise DriverError(
                f"DirectCudaResource on device {self._ordinal}: pointer collision on alloc ({ptr:#x} is already live)"
            )
        return block

    def deallocate(self, block: DeviceBlock) -> None:
        """Free ``block`` synchronously (``cuMemFree`` waits for the device first).

        Arguments and errors are those of :meth:`DeviceMemoryResource.deallocate`; a
        ``DriverError`` leaves the block live and counted again.

        Thread rule: any thread; the block leaves the map under the lock before the driver is
        called outside it, so a concurrent second free of it is refused.
        """
        check_device("DirectCudaResource.deallocate", self._ordinal, block)
        with self._lock:
            live = self._live.get(block.ptr)
            if live is None or live.generation != block.generation:
                raise unknown_block(
                    "DirectCudaResource.deallocate",
                    self._ordinal,
                    block,
                    None if live is None else int(live.generation),
                )
            del self._live[block.ptr]
            self._bytes -= live.nbytes
        try:
            self._driver.free(self._ordinal, block.ptr)
        except BaseException:
            with self._lock:
                self._live[block.ptr] = live
                self._bytes += live.nbytes
            raise

    def bytes_outstanding(self) -> int:
        """Bytes of the live blocks (a free completes before ``deallocate`` returns, so nothing
        is pending).

        Returns:
            The counter, read without the lock (one atomic read).
        Thread rule: any thread.
        """
        return self._bytes

    def live_blocks(self) -> list[DeviceBlock]:
        """The live blocks as they were handed out (no ages: allocation times are not recorded).

        Returns:
            A new list, taken under the lock.
        Thread rule: any thread.
        """
        with self._lock:
            return list(self._live.values())

    def describe(self) -> str:
        """``"direct"``. Thread rule: any thread."""
        return "direct"
