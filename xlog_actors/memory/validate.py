"""Argument checks shared by every resource. Each raises the SPEC's typed error and runs before
any state is touched."""

from __future__ import annotations

from ..driver.checks import check_nbytes
from ..errors import InvalidRequest, StreamMisuse, UseAfterFree
from .block import BlockId, DeviceBlock

__all__ = ["check_device", "check_nbytes", "unknown_block", "unknown_stream"]


def check_device(owner: str, ordinal: int, block: DeviceBlock | BlockId) -> None:
    if block.device_ordinal != ordinal:
        raise InvalidRequest(
            f"{owner}: block {block.ptr:#x} (generation {int(block.generation)}) belongs to device "
            f"{block.device_ordinal}, not to this resource's device {ordinal}"
        )


def unknown_block(owner: str, ordinal: int, block: DeviceBlock | BlockId, live_generation: int | None) -> UseAfterFree:
    if live_generation is None:
        why = "no live block at that address (already freed, or never allocated here)"
    else:
        why = f"the live block there is generation {live_generation}: the address was reused"
    return UseAfterFree(
        f"{owner} on device {ordinal}: block {block.ptr:#x} generation {int(block.generation)}: {why}",
        generation=int(block.generation),
    )


def unknown_stream(owner: str, ordinal: int, stream: object) -> StreamMisuse:
    return StreamMisuse(
        f"{owner} on device {ordinal}: unknown stream {stream!r}; streams come from "
        "StreamPool.acquire() of this device's current context"
    )
