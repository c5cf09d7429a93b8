"""``DirectCudaResource``: one synchronous driver allocation per call, the sanitizer backend."""

from __future__ import annotations

import threading

from ..driver.checks import check_device, check_nbytes, unknown_block
from ..driver.limits import ALIGNMENT
from ..driver.protocol import Driver
from ..errors import DriverError
from .block import AllocTag, DeviceBlock, Generation, StreamId, make_block
from .resource import DeviceMemoryResource

__all__ = ["DirectCudaResource"]


class DirectCudaResource(DeviceMemoryResource):
    """``cuMemAlloc``/``cuMemFree`` per call: no pool, no suballocation, so Compute Sanitizer
    sees every allocation's true bounds (the seeds left this raw backend as an open work item).

    The ``stream`` given to ``allocate`` is recorded on the block but binds nothing: the free is
    ``cuMemFree``, which synchronizes the device first. Cross-stream tracking is not offered (the
    hooks raise ``StreamMisuse``): code that needs it runs on ``AsyncCudaResource``.

    Thread rules: one lock guards the live map and the byte counter; the driver is called
    outside it.
    """

    __slots__ = ("_bytes", "_driver", "_live", "_lock", "_ordinal")

    def __init__(self, driver: Driver, ordinal: int) -> None:
        self._driver = driver
        self._ordinal = ordinal
        self._lock = threading.Lock()
        self._live: dict[int, DeviceBlock] = {}
        self._bytes = 0

    @property
    def device_ordinal(self) -> int:
        return self._ordinal

    @property
    def driver(self) -> Driver:
        return self._driver

    def allocate(
        self, nbytes: int, stream: StreamId = StreamId.DEFAULT, tag: AllocTag = AllocTag.UNTAGGED
    ) -> DeviceBlock:
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
        return self._bytes

    def live_blocks(self) -> list[DeviceBlock]:
        with self._lock:
            return list(self._live.values())

    def describe(self) -> str:
        return "direct"
