"""The demo's data: the kernel's constants, its input batches and what each must come out as.

A run cycles through a few distinct inputs built once, before timing starts, so the time measured
is the runtime's and not numpy's. Each input's expected output checksum (:func:`checksum_u32` of
``ALPHA * x + BETA``) is computed once too; a batch is verified by comparing the checksum the
device computed of its output with it, and a few batches also byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..driver.kernel_library import checksum_u32
from ..driver.protocol import Buffer

__all__ = ["ALPHA", "BETA", "BatchData", "Tally", "expected", "landed_output", "make_batch", "numpy_buffer"]

ALPHA = 3.0
"""The kernel's scale: each output element is ``ALPHA * x + BETA``."""
BETA = 0.5
"""The kernel's offset."""


def make_batch(index: int, n: int) -> np.ndarray:
    """Batch ``index``: small integers, so every result is exact in float32.

    Args:
        index: the batch's number (varies the values).
        n: elements.
    Returns:
        A new float32 array of ``n`` elements.
    Thread rule: any thread.
    """
    # ``(7 * i + 13 * index) % 4096`` in uint32 with a mask: a wrap past 2**32 leaves the low 12
    # bits as they are (4096 divides 2**32), and it is ten times faster than int64 with ``%``
    # (16 MiB batches took 35 ms each).
    values = np.arange(n, dtype=np.uint32)
    values *= np.uint32(7)
    values += np.uint32((index * 13) & 0xFFFF_FFFF)
    values &= np.uint32(4095)
    return values.astype(np.float32)


def expected(index: int, n: int) -> np.ndarray:
    """The host reference of batch ``index`` after the kernel: ``ALPHA * x + BETA`` in float32.

    Args:
        index: the batch's number.
        n: elements.
    Returns:
        A new float32 array.
    Thread rule: any thread.
    """
    out: np.ndarray = make_batch(index, n) * np.float32(ALPHA)
    out += np.float32(BETA)
    return out


def numpy_buffer(nbytes: int) -> np.ndarray:
    """A plain (pageable) host buffer of ``nbytes`` as a uint8 array: :class:`BatchData`'s default.

    Args:
        nbytes: its size.
    Returns:
        A new, uninitialised uint8 array.
    Thread rule: any thread.
    """
    return np.empty(nbytes, dtype=np.uint8)


class BatchData:
    """``count`` distinct input batches of ``nbytes`` each, built once into host buffers from
    ``alloc``, with the checksum each one's output must have. Batch ``i`` of a run uses input
    ``i % count``.

    Invariant: ``inputs[r]`` holds ``make_batch(r, n)`` and ``checksums[r]`` is
    ``checksum_u32(expected(r, n))``; nothing changes them after construction.
    Thread rule: built on one thread; then read-only, any thread.
    """

    def __init__(self, count: int, nbytes: int, alloc: Callable[[int], np.ndarray] = numpy_buffer) -> None:
        """Build the inputs and their checksums.

        Args:
            count: how many distinct inputs, at least 1.
            nbytes: bytes per batch, a positive multiple of 4.
            alloc: makes one host buffer of the given size, as a uint8 array.
        Raises:
            ValueError: ``count`` < 1, or ``nbytes`` not a positive multiple of 4.
        """
        if count < 1:
            raise ValueError(f"BatchData: count must be at least 1, got {count}")
        if nbytes <= 0 or nbytes % 4:
            raise ValueError(f"BatchData: nbytes must be a positive multiple of 4, got {nbytes}")
        self.nbytes = nbytes
        self.n = nbytes // 4
        self.inputs: list[np.ndarray] = []
        self.checksums: list[int] = []
        for r in range(count):
            buf = alloc(nbytes).view(np.float32)
            buf[:] = make_batch(r, self.n)
            self.inputs.append(buf)
            self.checksums.append(checksum_u32(expected(r, self.n)))

    def input(self, index: int) -> np.ndarray:
        """The host buffer batch ``index`` copies in (shared by every batch of the same input).

        Thread rule: any thread.
        """
        return self.inputs[index % len(self.inputs)]

    def checksum(self, index: int) -> int:
        """The checksum batch ``index``'s output must have. Thread rule: any thread."""
        return self.checksums[index % len(self.checksums)]

    def matches(self, index: int, output: Buffer) -> bool:
        """Whether ``output`` (a buffer of ``nbytes``) is batch ``index``'s expected output, byte
        for byte (the host reference, computed here: a check for a few batches, not all).

        Thread rule: any thread.
        """
        want = expected(index % len(self.inputs), self.n)
        got = np.frombuffer(memoryview(output).cast("B"), dtype=np.float32)
        return got.shape == want.shape and bool(np.array_equal(got.view(np.uint32), want.view(np.uint32)))


def landed_output(out: Any, nbytes: int) -> Buffer:
    """The first ``nbytes`` a copy back left in ``out`` (a pinned buffer, once the copy landed):
    the one place a run reads what it compares byte for byte.

    Args:
        out: the buffer (anything with ``array(dtype, count)``: a ``PinnedBuffer``).
        nbytes: how many bytes.
    Returns:
        a uint8 view of them.
    Thread rule: any thread.
    """
    view: Buffer = out.array(np.uint8, nbytes)
    return view


class Tally:
    """The verification of one run's batches, the same in every mode of the demo: each batch by
    the checksum it added to its slot's running sum as it lands, and, after the timed part, byte
    for byte the batches whose copies back went to buffers of their own (``kept``: batch ->
    a buffer with ``array(dtype, count)``, filled in by the run as it makes them).

    The running sum is never zeroed between batches (one launch fewer per batch): a batch's
    checksum is what it added, modulo 2**64.

    Thread rule: the run's orchestrating thread.
    """

    def __init__(self, data: BatchData, kept: Mapping[int, Any]) -> None:
        """Args:
            data: the run's inputs and their checksums.
            kept: batch -> the buffer its copy back went to, for the batches compared byte for
                byte (the run's own dict: it may fill it in after).
        """
        self.data, self.kept = data, kept
        self.verified = 0
        self.mismatched: list[int] = []
        self.to_compare: list[int] = []  # checksum right; compared byte for byte after the timed run
        self.compared = 0

    @property
    def done(self) -> int:
        """Batches verified (or waiting for their byte compare) or found wrong."""
        return self.verified + len(self.to_compare) + len(self.mismatched)

    def checksum(self, index: int, before: int, total: int) -> None:
        """Judge batch ``index`` by its slot's running sum: ``before`` it ran, ``total`` after."""
        if (total - before) % (1 << 64) != self.data.checksum(index):
            self.mismatched.append(index)
        elif index in self.kept:
            self.to_compare.append(index)
        else:
            self.verified += 1

    def compare_kept(self, nbytes: int) -> None:
        """Compare the kept batches' first ``nbytes`` with the host reference (after the timed run)."""
        for index in self.to_compare:
            self.compared += 1
            if self.data.matches(index, landed_output(self.kept[index], nbytes)):
                self.verified += 1
            else:
                self.mismatched.append(index)
        self.to_compare = []
