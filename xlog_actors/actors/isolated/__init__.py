"""A device in its own process: ``DeviceActor.start(ordinal, ..., isolate=True)``.

The parent keeps a proxy actor (:class:`IsolatedDevice`) whose ``ActorRef`` outlives the child
processes behind it; each child runs a normal ``DeviceActor`` on its own driver. A sticky error,
a crash, ``os._exit`` or ``SIGKILL`` ends only the child: the parent starts a new one, bumps the
generation, tells subscribers ``GenerationChanged`` and answers every waiting asker with a typed
error. Modules: ``_protocol`` (the frames and the ``ChildFault`` test hook), ``_child`` (the child
process), ``_remote`` (the context of parent-side handles), ``_library`` (the parent-side
``CopyActor``/``KernelActor`` whose work runs in the child), and the proxy's pieces: ``_proxy``
(the proxy actor: forwarding and the fast path), ``_process`` (a child process and its boot
handshake), ``_link`` (the parent's record of a serving child: pipelined asks, frees,
generations), ``_reader`` (the reader thread: replies, and a death answering every asker),
``_lane`` (the call lane) and ``_restarts`` (the serving child, its reserve and its restarts).
"""

from __future__ import annotations

from ._library import IsolatedLibrary
from ._process import READY_TIMEOUT_S
from ._protocol import ChildFault
from ._proxy import ChildTimeline, IsolatedDevice, start_isolated
from ._remote import RemoteContext

__all__ = [
    "READY_TIMEOUT_S", "ChildFault", "ChildTimeline", "IsolatedDevice", "IsolatedLibrary", "RemoteContext",
    "start_isolated",
]
