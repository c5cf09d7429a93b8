"""``RemoteContext``: what a ``GpuRef`` in the parent holds instead of a ``DeviceContext``: one
generation of one child process of an isolated device.

A parent-side ``GpuRef`` is the ordinary handle (``make_handle`` over this context): it validates
on every ``access()`` against the parent's ``DeviceState`` of its child process, which the proxy
bumps when the child rebuilds its context or dies, and poisons when the child reported a sticky
error. Its drop or ``release()`` queues its address in the child's free queue, which the proxy
sends to that child (batched); a context whose child died, or whose generation was replaced, is
closed and frees nothing, so nothing is ever freed into a newer child.

The context also carries its child's :class:`LibraryWorkCount`: how much library work (the only
way anything writes the child's memory) was sent and answered, which tells a copy actor of another
device whether an export it keeps is still that of the handle's last write.

Thread rule: ``reclaim`` may run on any thread (a garbage collector's included): it appends to a
``deque`` (atomic) and may call the wake-up, a pykka ``tell``; everything else is read-only after
construction but ``open``, which the proxy clears, and the work count (see its class).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import pykka

from ...errors import DeviceUnavailable
from ...memory.block import DeviceBlock
from ..device_context import RECLAIM_BATCH, RECLAIM_WAKE_BYTES
from ..device_state import DeviceState
from ._protocol import ExportHandle

#: How long pickling a parent-side handle waits for its child's export, in seconds.
EXPORT_TIMEOUT_S = 30.0

__all__ = ["LibraryWorkCount", "RemoteContext", "RemoteDriverFace"]


class LibraryWorkCount:
    """The ``LibraryWork`` messages the proxy sent to one child (``sent``) and the replies the
    reader read for them (``answered``). Every write to the child's memory that a handle's last
    write records is library work; so while the pair reads the same and nothing was in flight
    when an export was made, that export's event still marks its handle's last write.

    Thread rule: ``sent`` is counted before the work is sent, by whichever thread sends it (the
    proxy's, or an asker's on the fast path: several at once, so through :meth:`count_sent` and
    :meth:`uncount_sent`, under a lock); ``answered`` by the reader thread before it answers the
    asker (its one writer); any thread reads :meth:`mark`.
    """

    __slots__ = ("_lock", "answered", "sent")

    def __init__(self) -> None:
        """Nothing sent, nothing answered."""
        self._lock = threading.Lock()
        self.sent = 0
        self.answered = 0

    def count_sent(self) -> None:
        """One more piece of work is about to be sent (counted before it can run).
        Thread rule: any thread."""
        with self._lock:
            self.sent += 1

    def uncount_sent(self) -> None:
        """The work :meth:`count_sent` counted was not sent after all. Thread rule: any thread."""
        with self._lock:
            self.sent -= 1

    def mark(self) -> tuple[int, int]:
        """``(sent, answered)`` now. Thread rule: any thread."""
        return (self.sent, self.answered)


class RemoteDriverFace:
    """What a parent-side handle says its driver is: ``kind`` names the isolation, so the
    interop exports (CUDA driver only) are refused in the parent with that reason.

    Thread rule: immutable; any thread.
    """

    __slots__ = ("kind",)

    def __init__(self, child_kind: str) -> None:
        """Args:
            child_kind: the child's driver kind.
        """
        self.kind = f"an isolated {child_kind} device in another process"


class RemoteContext:
    """One generation of one child process, as the parent's handles see it.

    Fields: ``owner`` (the proxy's actor URN), ``generation`` (the parent's),
    ``child_generation`` (the child's own, sent back with frees), ``state_ref`` and ``token``
    (what ``make_handle`` takes), ``ordinal``, ``driver`` (a :class:`RemoteDriverFace`), ``open``,
    ``work`` (the child's :class:`LibraryWorkCount`).

    Thread rule: see the module docstring.
    """

    __slots__ = (
        "__weakref__", "_frees", "_state", "_wake", "child_generation", "driver", "generation", "open", "ordinal",
        "owner", "state_ref", "token", "work",
    )

    def __init__(
        self,
        owner: str,
        state: DeviceState,
        generation: int,
        token: object,
        child_generation: int,
        frees: deque[tuple[int, int]],
        wake: Callable[[], None],
        driver: RemoteDriverFace,
        work: LibraryWorkCount | None = None,
    ) -> None:
        """Args:
            owner: the proxy's actor URN (``Free`` checks a handle is its own).
            state: the parent's state of this child; the context keeps it alive (handles hold it
                weakly).
            generation: the parent's generation of this context.
            token: the state's token the handles validate against (a fresh object for a
                generation already replaced: its handles are stale from birth).
            child_generation: the child's generation this context stands for.
            frees: the child's queue of ``(child_generation, ptr)`` to free.
            wake: asks the proxy to send the queue now.
            driver: the face the handles show as their driver.
            work: the child's library work count (a fresh one when None).
        Thread rule: the proxy's threads.
        """
        self._state = state
        self.state_ref = weakref.ref(state)
        self.owner = owner
        self.generation = generation
        self.token = token
        self.child_generation = child_generation
        self.ordinal = state.device_id
        self.driver = driver
        self.open = True
        self._frees = frees
        self._wake = wake
        self.work = LibraryWorkCount() if work is None else work

    def __repr__(self) -> str:
        return (
            f"RemoteContext(device={self.ordinal}, generation={self.generation}, "
            f"child_generation={self.child_generation}, open={self.open})"
        )

    def is_current(self) -> bool:
        """True while this is the generation the child serves. Thread rule: any thread."""
        return self.open and self._state.token is self.token

    def reclaim(self, block: DeviceBlock, wake: bool = False) -> None:
        """Queue the free of ``block`` for the child (a handle was dropped or released).

        Args:
            block: the handle's block.
            wake: send the queue now (``release()``); otherwise a large block or a full batch
                does, or the proxy's next message.
        Thread rule: any thread, a garbage collector's included.
        """
        if not self.open:
            return  # the child, or this generation of it, is gone: so is the memory
        self._frees.append((self.child_generation, block.ptr))
        if wake or block.nbytes >= RECLAIM_WAKE_BYTES or len(self._frees) >= RECLAIM_BATCH:
            self._wake()

    def export(self, ref: Any) -> Any:
        """Have the child export ``ref`` (``shared_ref.export_ref`` calls it for a parent-side
        handle): the child names its memory and takes the count; the caller adds the parent's
        generation cell.

        Returns:
            The child's ``GpuRefExport``.
        Raises:
            GpuRefStale: the handle's child or generation was replaced, or it was freed there.
            DeviceUnavailable: the proxy is gone, or the child did not answer in
                :data:`EXPORT_TIMEOUT_S`.
            InvalidRequest, DriverError: from the child's export.
        Thread rule: any thread but the proxy's own.
        """
        proxy = pykka.ActorRegistry.get_by_urn(self.owner)
        if proxy is None:
            raise DeviceUnavailable(f"isolated device {self.ordinal}: its proxy actor is gone")
        try:
            return proxy.ask(ExportHandle(ref), timeout=EXPORT_TIMEOUT_S)
        except pykka.Timeout:
            raise DeviceUnavailable(
                f"isolated device {self.ordinal}: the child did not export in {EXPORT_TIMEOUT_S} s"
            ) from None
        except pykka.ActorDeadError:
            raise DeviceUnavailable(f"isolated device {self.ordinal}: its proxy actor stopped") from None
