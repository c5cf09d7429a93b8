"""``GuardResource``: canary bytes around every allocation, checked on free; freed bytes
poisoned. A debug adaptor for finding out-of-bounds writes and uses after free."""

from __future__ import annotations

import math
import threading

from ...driver.checks import check_device, check_nbytes, unknown_block, unknown_stream
from ...driver.host import POISON_BYTE
from ...driver.limits import ALIGNMENT
from ...driver.protocol import Driver, Stream
from ...errors import CorruptionDetected, InvalidRequest
from ..block import Access, AllocTag, BlockId, DeviceBlock, LiveBlock, StreamId, make_block
from ..resource import DeviceMemoryResource
from ..sizes import format_size
from ..stream_pool import StreamPool
from .upstream import ResourceAdaptor

__all__ = ["CANARY_PATTERN", "DEFAULT_GUARD_BYTES", "GuardResource", "check_guard_bytes"]

#: The size of each canary when none is given: the allocation alignment (256 bytes), the least
#: that keeps the block as aligned as the upstream's.
DEFAULT_GUARD_BYTES = ALIGNMENT
#: The bytes a canary repeats. It contains neither 0x00 nor the poison byte, so a stray memset to
#: either is caught, and no byte twice in a row, so a stray fill with any single byte value is
#: caught.
CANARY_PATTERN = b"\xca\xfe\xba\xbe\xf0\x0d\xfa\xce"



def check_guard_bytes(guard_bytes: object) -> int:
    """The size of each canary, checked.

    Args:
        guard_bytes: the size asked for.
    Returns:
        it, as an int.
    Raises:
        InvalidRequest: not a positive int, or not a multiple of the allocation alignment (256).
    Thread rule: any thread.
    """
    checked = check_nbytes(guard_bytes, "guard size")
    if checked % ALIGNMENT:
        raise InvalidRequest(f"guard size must be a multiple of {ALIGNMENT} bytes, got {checked}")
    return checked

class GuardResource(ResourceAdaptor):
    """Allocates ``nbytes + 2 * guard_bytes`` upstream and hands out the middle: the block's
    ``ptr`` is the upstream pointer plus ``guard_bytes`` (a multiple of 256, so the block keeps
    the upstream's alignment), and the ``guard_bytes`` before it and after its last byte hold
    :data:`CANARY_PATTERN`.

    On ``deallocate`` both canaries are read back; the block's bytes (canaries included) are
    then poisoned with ``0xDD`` and freed upstream, and only after that, when a canary was
    overwritten, :class:`~xlog_actors.errors.CorruptionDetected` is raised naming the block's
    tag, size, stream and where the damage starts. Nothing leaks either way.

    Ordering: the canaries are written and read on the block's allocation stream (resolved in
    the upstream's ``stream_pool``), so the allocation-ready fence a consumer on another stream
    waits for covers them too; before the read, ``prepare_block_use(..., WRITE)`` makes that
    stream wait for every use the upstream tracked, so the check sees all of them. A stack
    without a stream pool (``"direct+guard"``) uses a stream of the guard's own, synchronized
    before the block is handed out, and checks what is complete when that stream is
    synchronized at the free: synchronize the streams that used a block before freeing it, as
    ``DirectCudaResource`` requires anyway. The free blocks the calling thread until the
    canaries are on the host: this is a debug adaptor.

    Block identity: the guard's block has the upstream block's generation; the tracking hooks
    and ``live_blocks()`` translate between the two. ``bytes_outstanding()`` is the upstream's:
    what the device really holds, canaries included.

    Invariants: a free that raises before the upstream freed the block leaves it live and
    tracked (its bytes may already be poisoned when the failure came late); a block being freed
    is taken out of the guard's map first, so a concurrent second free of it is refused instead
    of poisoning memory that may already belong to someone else.

    Thread rule: every method may be called from any thread at any time. One lock guards the
    guard's map (guard pointer -> upstream block); the driver and the upstream are called outside
    it.
    """

    __slots__ = ("_canary", "_driver", "_guard", "_live", "_lock", "_own_stream", "_pool")

    def __init__(
        self, upstream: DeviceMemoryResource, guard_bytes: int = DEFAULT_GUARD_BYTES
    ) -> None:
        """Guard every block of ``upstream`` with canaries of ``guard_bytes`` on each side.

        Args:
            upstream: the resource to wrap; it must expose its ``driver`` (every base resource
                and every stack of them does).
            guard_bytes: the size of each canary, a positive multiple of 256.
        Raises:
            InvalidRequest: ``upstream`` is not a ``DeviceMemoryResource``, ``guard_bytes`` is
                not a positive multiple of 256, or ``upstream`` exposes no driver.
            DriverError: a stack without a stream pool needs a stream of the guard's own, and the
                driver could not create it.
        Thread rule: any thread.
        """
        super().__init__(upstream)
        guard_bytes = check_guard_bytes(guard_bytes)
        driver: Driver | None = getattr(upstream, "driver", None)
        if driver is None:
            raise InvalidRequest(
                f"GuardResource needs an upstream that exposes its driver; {upstream.describe()} does not"
            )
        self._guard = guard_bytes
        self._driver = driver
        self._pool: StreamPool | None = getattr(upstream, "stream_pool", None)
        self._own_stream: Stream | None = (
            driver.create_stream(upstream.device_ordinal) if self._pool is None else None
        )
        self._canary = (CANARY_PATTERN * (guard_bytes // len(CANARY_PATTERN) + 1))[:guard_bytes]
        self._lock = threading.Lock()
        self._live: dict[int, DeviceBlock] = {}

    @property
    def guard_bytes(self) -> int:
        """The size of each canary, in bytes. Thread rule: any thread."""
        return self._guard

    def label(self) -> str:
        """``"guard"``, or ``"guard:SIZE"`` for a size other than the default. Thread rule: any
        thread."""
        return (
            "guard" if self._guard == DEFAULT_GUARD_BYTES else f"guard:{format_size(self._guard)}"
        )

    def close(self) -> None:
        """Close the guard's own stream, if it made one. Idempotent.

        Thread rule: any thread, once no allocate or deallocate is running on this guard.
        """
        if self._own_stream is not None:
            self._own_stream.close()

    def _stream(self, owner: str, stream_id: StreamId) -> Stream:
        if self._pool is None:
            assert self._own_stream is not None  # made in __init__ whenever there is no pool
            return self._own_stream
        stream = self._pool.resolve(stream_id)
        if stream is None:
            raise unknown_stream(owner, self.device_ordinal, stream_id)
        return stream

    # -- allocation -------------------------------------------------------------------------
    def allocate(
        self, nbytes: int, stream: StreamId = StreamId.DEFAULT, tag: AllocTag = AllocTag.UNTAGGED
    ) -> DeviceBlock:
        """Allocate ``nbytes`` plus two canaries upstream, write the canaries, hand out the middle.

        Args:
            nbytes: a positive ``int``.
            stream: the allocation stream, as upstream.
            tag: what the allocation is for.
        Returns:
            A live block of ``nbytes`` whose ``ptr`` is past the front canary and whose
            generation is the upstream block's.
        Raises:
            InvalidRequest: ``nbytes`` is not a positive ``int``.
            StreamMisuse: ``stream`` is not a stream of the upstream's pool.
            OutOfMemory: the upstream cannot satisfy the request.
            DriverError: the upstream or a canary write failed; the upstream block was given back.
        Thread rule: any thread.
        """
        nbytes = check_nbytes(nbytes)
        g = self._guard
        up = self._upstream.allocate(nbytes + 2 * g, stream, tag)
        try:
            s = self._stream("GuardResource.allocate", up.alloc_stream)
            self._driver.copy_to_device(up.ptr, self._canary, s)
            self._driver.copy_to_device(up.ptr + g + nbytes, self._canary, s)
            if self._pool is None:
                # Nothing orders the guard's own stream before the user's streams: the canaries
                # must be in place before the block is handed out, or a late canary write could
                # hide an overrun (or land after the user's own writes).
                s.synchronize()
        except BaseException:
            self._upstream.deallocate(up)
            raise
        block = make_block(
            up.ptr + g,
            up.device_ordinal,
            up.alloc_stream,
            nbytes,
            math.gcd(up.align, g),
            up.tag,
            up.generation,
        )
        with self._lock:
            self._live[block.ptr] = up
        return block

    def deallocate(self, block: DeviceBlock) -> None:
        """Check both canaries, poison the block, free it upstream, then report any damage.

        Blocks the calling thread until the canaries are on the host.

        Args:
            block: a live block of this guard.
        Raises:
            InvalidRequest: ``block`` is of another device.
            UseAfterFree: the guard has no live block with this ``(ptr, generation)`` (also a
                second free racing the first).
            CorruptionDetected: a canary was overwritten; the block *was* freed.
            StreamMisuse, DriverError: the check or the upstream free failed; the block stays
                live and tracked.
        Thread rule: any thread.
        """
        owner = "GuardResource.deallocate"
        check_device(owner, self.device_ordinal, block)
        with self._lock:
            up = self._live.pop(block.ptr, None)
            if up is None or up.generation != block.generation:
                if up is not None:
                    self._live[block.ptr] = up
                raise unknown_block(
                    owner, self.device_ordinal, block, None if up is None else int(up.generation)
                )
        g = self._guard
        driver = self._driver
        nbytes = up.nbytes - 2 * g  # from the guard's own record, not from the caller's block
        try:
            s = self._stream(owner, up.alloc_stream)
            if self._upstream.supports_block_use_tracking():
                # Order the read after every tracked use of the block on other streams.
                self._upstream.prepare_block_use(
                    BlockId.from_block(up), up.alloc_stream, Access.WRITE
                )
            head = driver.copy_to_host(up.ptr, g, s)
            tail = driver.copy_to_host(up.ptr + g + nbytes, g, s)
            # Poison before the free (a use after free reads 0xDD on every driver, also where
            # the memory stays cached in a pool). Stream order puts it after the reads, and one
            # synchronize covers both: the reads' results, and the fill being done before a
            # free that is not ordered on this stream (the synchronous one of "direct").
            driver.fill(up.ptr, POISON_BYTE, up.nbytes, s)
            s.synchronize()
            damage = self._damage(head, tail, nbytes)
            self._upstream.deallocate(up)
        except BaseException:
            with self._lock:
                self._live[block.ptr] = up
            raise
        if damage is not None:
            raise CorruptionDetected(
                f"GuardResource on device {self.device_ordinal}: block {block.ptr:#x} of {block.nbytes} "
                f"bytes, tag {block.tag}, stream {int(block.alloc_stream)}, generation "
                f"{int(block.generation)}: {damage}. The block was freed.",
                block=block,
            )

    def _damage(self, head: bytearray, tail: bytearray, nbytes: int) -> str | None:
        """Where the canaries were overwritten, in words, or None when both are intact."""
        found = []
        g = self._guard
        if (damage := self._overwritten(head)) is not None:
            first, changed = damage
            found.append(f"canary before the block overwritten from {g - first} bytes before its start ({changed})")
        if (damage := self._overwritten(tail)) is not None:
            first, changed = damage
            past = f"{first} bytes past its end"
            found.append(f"canary after the block overwritten from offset {nbytes + first} ({past}; {changed})")
        return "; ".join(found) or None

    def _overwritten(self, canary: bytearray) -> tuple[int, str] | None:
        """The offset of the first changed byte of a canary read back, and how many changed in
        words; None when it is intact."""
        if canary == self._canary:
            return None
        changed = [i for i, (a, b) in enumerate(zip(canary, self._canary, strict=False)) if a != b]
        return changed[0], f"{len(changed)} of {self._guard} bytes changed"

    # -- identity translation ---------------------------------------------------------------
    def _upstream_block(self, owner: str, block_id: BlockId | DeviceBlock) -> DeviceBlock:
        check_device(owner, self.device_ordinal, block_id)
        with self._lock:
            up = self._live.get(block_id.ptr)
        if up is None or up.generation != block_id.generation:
            raise unknown_block(
                owner, self.device_ordinal, block_id, None if up is None else int(up.generation)
            )
        return up

    def _tracked(self, hook: str, block_id: BlockId | DeviceBlock) -> DeviceBlock:
        """The upstream block behind ``block_id``, for the tracking hook ``hook``."""
        if not self._upstream.supports_block_use_tracking():
            raise self._unsupported(hook)
        return self._upstream_block(f"GuardResource.{hook}", block_id)

    def record_block_use(self, block: DeviceBlock, use_stream: StreamId) -> None:
        """The upstream's ``record_block_use`` on the upstream block behind ``block``.

        Args:
            block: a live block of this guard.
            use_stream: as the upstream's.
        Raises:
            StreamMisuse: the upstream does not track block uses, or as the upstream.
            InvalidRequest: ``block`` is of another device.
            UseAfterFree: ``block`` is not live in this guard.
        Thread rule: any thread.
        """
        self._upstream.record_block_use(self._tracked("record_block_use", block), use_stream)

    def prepare_block_use(self, block_id: BlockId, use_stream: StreamId, access: Access) -> None:
        """The upstream's ``prepare_block_use`` on the upstream block behind ``block_id``;
        arguments, errors and thread rule as :meth:`record_block_use`."""
        up = self._tracked("prepare_block_use", block_id)
        self._upstream.prepare_block_use(BlockId.from_block(up), use_stream, access)

    def finish_block_use(self, block_id: BlockId, use_stream: StreamId, access: Access) -> None:
        """The upstream's ``finish_block_use`` on the upstream block behind ``block_id``;
        arguments, errors and thread rule as :meth:`record_block_use`."""
        up = self._tracked("finish_block_use", block_id)
        self._upstream.finish_block_use(BlockId.from_block(up), use_stream, access)

    def live_blocks(self) -> list[LiveBlock | DeviceBlock]:
        """The upstream's live blocks as this guard hands them out.

        Returns:
            The upstream's list, each block of this guard shown with its pointer past the front
            canary and its size without the canaries; blocks allocated around the guard as they
            are.
        Raises:
            AttributeError: the upstream lists no live blocks.
        Thread rule: any thread.
        """
        g = self._guard
        # live_blocks() is a diagnostic of the base resources, outside the resource interface.
        entries: list[LiveBlock | DeviceBlock] = self._upstream.live_blocks()  # type: ignore[attr-defined]
        with self._lock:
            ours = {up.ptr for up in self._live.values()}
        out: list[LiveBlock | DeviceBlock] = []
        for e in entries:
            if e.ptr not in ours:
                out.append(e)
            elif isinstance(e, DeviceBlock):
                out.append(
                    make_block(
                        e.ptr + g,
                        e.device_ordinal,
                        e.alloc_stream,
                        e.nbytes - 2 * g,
                        math.gcd(e.align, g),
                        e.tag,
                        e.generation,
                    )
                )
            else:
                out.append(LiveBlock(e.ptr + g, e.nbytes - 2 * g, e.tag, e.stream, e.age_s))
        return out

    def pending_use_event_count(self, ptr: int) -> int | None:
        """The upstream's count for the block this guard handed out at ``ptr``.

        Args:
            ptr: a pointer this guard handed out (any other is passed through as it is).
        Returns:
            As the upstream's ``pending_use_event_count``.
        Raises:
            AttributeError: the upstream has no such diagnostic.
        Thread rule: any thread.
        """
        with self._lock:
            up = self._live.get(ptr)
        # a diagnostic of the async resource, outside the resource interface
        count: int | None = self._upstream.pending_use_event_count(  # type: ignore[attr-defined]
            ptr if up is None else up.ptr
        )
        return count
