"""Messages of the library actors (``CopyActor``, ``KernelActor``) and kernel argument wrappers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..driver.kernel import Kernel
from ..memory.block import Access
from .gpu_ref import GpuRef

__all__ = [
    "BufferArg",
    "CopyDeviceToDevice",
    "CopyToDevice",
    "CopyToHost",
    "Fill",
    "In",
    "InOut",
    "Launch",
    "Out",
]


@dataclass(frozen=True, slots=True)
class CopyToDevice:
    """Reply: None once the copy is enqueued. ``data`` (any buffer) lands at the start of
    ``ref``; it may be shorter than the allocation."""

    ref: GpuRef
    data: Any


@dataclass(frozen=True, slots=True)
class CopyToHost:
    """Reply: ``bytes`` of the first ``nbytes`` (default: all) of ``ref``, once on the host."""

    ref: GpuRef
    nbytes: int | None = None


@dataclass(frozen=True, slots=True)
class CopyDeviceToDevice:
    """Reply: None once enqueued. Copies all of ``src`` to the start of ``dst``."""

    src: GpuRef
    dst: GpuRef


@dataclass(frozen=True, slots=True)
class Fill:
    """Reply: None once enqueued. Sets every byte of ``ref`` to ``byte``."""

    ref: GpuRef
    byte: int


@dataclass(frozen=True, slots=True)
class BufferArg:
    ref: GpuRef
    access: Access


def In(ref: GpuRef) -> BufferArg:
    """A kernel argument the kernel only reads."""
    return BufferArg(ref, Access.READ)


def Out(ref: GpuRef) -> BufferArg:
    """A kernel argument the kernel only writes."""
    return BufferArg(ref, Access.WRITE)


def InOut(ref: GpuRef) -> BufferArg:
    """A kernel argument the kernel reads and writes."""
    return BufferArg(ref, Access.READ_WRITE)


@dataclass(frozen=True, slots=True)
class Launch:
    """Reply: None once the kernel is enqueued. ``args`` are ``In``/``Out``/``InOut`` buffers
    and scalars, in the kernel's parameter order."""

    kernel: Kernel
    grid: int | Sequence[int]
    block: int | Sequence[int]
    args: Sequence[Any]
