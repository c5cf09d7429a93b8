"""Kept copy sources across the pipe: the source of a ``CopyDeviceToDevice`` whose export an
isolated device's parent-side copy actor keeps crosses to the child as a :class:`KeptSource`, not
as a ``SharedGpuRef``, and the child serves it from the handle it made of that export the first
time (:class:`KeptImports`).

A ``SharedGpuRef`` in a frame costs a count of the owner's export slot on each side: pickling it
takes one under the export table's file lock, the child's import adopts it and gives it back under
the same lock when the copy's handle is dropped. A kept export is the same descriptor copy after
copy (:mod:`._library` keeps it while the source's device got no library work), so after its first
crossing the child already holds a handle of it:

* **The parent** gives each kept export one :class:`KeptSource` when it keeps it: an ``ident``
  that no other kept export of this process ever gets, and the export's descriptor pickled once
  (``descriptor``: the bytes of a ``GpuRefExport``, no count with them). The first copy of that
  export sends the token with the export in full (``carry``: the ``SharedGpuRef`` crosses too, its
  pickle taking a count for the child, as any full export's); every later copy sends the same
  token object, which pickles as its two fields, no lock and no count. The token also holds the
  parent's kept ``SharedGpuRef`` (``shared``): the message in the link's ``pending`` table holds
  the token until the child's reply is read, so the parent's count of the slot is held while any
  frame naming the token is in flight, even when the kept export was dropped meanwhile.
* **The child** (:class:`KeptImports`, one per parent-side library actor, used by the frame
  reader) maps ``ident`` to the handle it got of that export: a hit is a dict look-up and a
  compare of the descriptor's bytes with those the handle was made of (equal bytes, the same
  export: what a parent that gave an ``ident`` twice would get wrong), no count and no import. A
  miss keeps the handle the token carried (the first crossing), or, when it carried none (a new
  child after a restart, an entry evicted or dropped), makes one from the descriptor with a count
  of its own (``shared_ref.adopt``: the parent's count, held as above, keeps the slot alive
  meanwhile, so only a source its owner's generation gave up fails, stale, as its full export
  would).

Lifetime: an ``ident`` names one export, so a hit serves the same descriptor (the same interprocess
event, the same generation) the frame would have carried in full; a source written since, rebuilt,
restarted or released is a new kept export or none, never the old ``ident``. The child drops an
entry when the parent forgets it (``LibraryWork.forget``: sent only once every frame that named it
was answered, so no later frame names it), when its table passes its capacity (the parent's
bound, ``_library.KEPT_EXPORTS``; least recently used first), when its source's owner moved to a
new generation (at the next token served, as the import cache drops its entries), when the child's
own device moves to a new generation (a rebuild there ends every token issued before it, as a
restart does by ending the process), and all of them when the library actor stops
(``LibraryStop``). Dropping one closes its mapping and gives its count back.

Thread rules: a :class:`KeptSource` is immutable (any thread); a :class:`KeptImports` is used by
the child's frame reader only.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from typing import Any

from ..import_cache import usable
from ..shared_ref import SharedGpuRef, adopt

__all__ = ["KeptImports", "KeptSource"]


class KeptSource:
    """The wire form of a kept copy source; see the module docstring.

    Fields: ``ident`` (unique among the kept exports of the parent process), ``descriptor`` (the
    pickled ``GpuRefExport``, no count with it), ``shared`` (the parent's kept handle, held while
    the token is; in the child, the handle that crossed with it, or None), ``carry`` (whether
    ``shared`` crosses with the token, the export's first copy; in the child, whether it did).

    Thread rule: immutable; any thread.
    """

    __slots__ = ("carry", "descriptor", "ident", "shared")

    def __init__(self, ident: int, descriptor: bytes, shared: SharedGpuRef | None = None,
                 carry: bool = False) -> None:
        """Args:
            ident: the kept export's number.
            descriptor: its ``GpuRefExport``, pickled.
            shared: the parent's handle of it.
            carry: pickle ``shared`` with the token (a count taken for the child).
        """
        self.ident = ident
        self.descriptor = descriptor
        self.shared = shared
        self.carry = carry

    def carrying(self) -> KeptSource:
        """The same token, crossing with its handle (the export's first copy). Thread rule: any
        thread."""
        return KeptSource(self.ident, self.descriptor, self.shared, True)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if self.carry:
            return (KeptSource, (self.ident, self.descriptor, self.shared, True))
        return (KeptSource, (self.ident, self.descriptor))

    def __repr__(self) -> str:
        return f"KeptSource({self.ident}, {self.shared!r})"


def _same(kept: bytes, crossed: bytes) -> bool:
    """Whether a kept handle's descriptor bytes are those a token crossed with (one export)."""
    return kept == crossed


class KeptImports:
    """The child's handles of one parent-side library actor's kept sources, by ``ident``; see
    the module docstring. Counters for tests and reports: ``hits`` (tokens served from a kept
    handle), ``carried`` (handles that crossed with their token), ``adopted`` (handles made from
    a descriptor).

    Thread rule: the child's frame reader only.
    """

    __slots__ = ("_capacity", "_entries", "_generation", "adopted", "carried", "hits")

    def __init__(self, capacity: int) -> None:
        """Args:
            capacity: the most handles kept (least recently used dropped first; a token of one
                dropped is then served from its descriptor again).
        """
        self._capacity = capacity
        self._entries: OrderedDict[int, tuple[SharedGpuRef, bytes]] = OrderedDict()  # ident -> (handle, its bytes)
        self._generation: int | None = None
        self.hits = 0
        self.carried = 0
        self.adopted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def resolve(self, source: KeptSource, generation: int) -> SharedGpuRef:
        """The handle a copy from ``source`` uses: the one kept under its ``ident`` when it was
        made of the same descriptor, else the one the token carried, else one made from the
        descriptor (with a count of its own), kept in its place.

        Args:
            source: the token, as it crossed.
            generation: the child's own device generation now (a new one drops every entry
                first).
        Returns:
            The handle; one of a source that went stale is stale (its ``access()`` raises), as
            a full export's import would be.
        Raises:
            pickle.UnpicklingError, and what unpickling a descriptor raises: a malformed token.
        Thread rule: the frame reader.
        """
        entries = self._entries
        if generation != self._generation:
            self._generation = generation
            entries.clear()
        for stale in [ident for ident, (ref, _) in entries.items() if not usable(ref)]:
            del entries[stale]  # its owner moved on: its mapping closes now, as the import cache's do
        ident, descriptor = source.ident, source.descriptor
        entry = entries.get(ident)
        if entry is not None and _same(entry[1], descriptor):
            entries.move_to_end(ident)
            self.hits += 1
            return entry[0]
        ref = source.shared if source.carry else None
        if ref is not None:
            self.carried += 1
        else:
            ref = adopt(pickle.loads(descriptor))
            self.adopted += 1
        entries[ident] = (ref, descriptor)
        entries.move_to_end(ident)
        while len(entries) > self._capacity:
            entries.popitem(last=False)
        return ref

    def forget(self, idents: tuple[int, ...]) -> None:
        """Drop the handles of ``idents`` (those not kept are skipped): their counts go back.
        Thread rule: the frame reader."""
        for ident in idents:
            self._entries.pop(ident, None)

    def clear(self) -> None:
        """Drop every handle. Thread rule: the frame reader."""
        self._entries.clear()
