"""The other process of the cross-process handle tests: a spawned peer that receives pickled
``GpuRef``s over a pipe and answers what it read or found.

It is a top-level module of its own folder (the test puts the folder on ``sys.path``) because a
spawned process imports its target by module name, and pytest's importlib mode gives test
modules names a child cannot import. It starts no ``DeviceActor``: the handles arrive as
``SharedGpuRef``s.

Commands (tuples): ``("read", ref, ordered, nbytes)`` reads the first bytes at once and answers
them; ``("hold", ref)`` keeps the handle; ``("access",)`` answers ``"ok"`` or the stale reason of
the held handle; ``("forward", conn)`` is not offered (one peer is enough); ``("drop",)``
releases the held handle; ``("stop",)`` ends the peer.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

from xlog_actors.errors import GpuRefStale


def serve(conn: Connection) -> None:
    """Answer commands on ``conn`` until ``stop`` or the end of the pipe."""
    held: Any = None
    conn.send("ready")
    while True:
        try:
            command = conn.recv()
        except EOFError:
            return
        kind = command[0]
        if kind == "read":
            _, ref, ordered, nbytes = command
            conn.send(bytes(ref.view(ordered=ordered, timeout_s=10.0)[:nbytes]))
            ref.release()
        elif kind == "hold":
            held = command[1]
            conn.send(("held", type(held).__name__))
        elif kind == "access":
            try:
                held.access()
                conn.send("ok")
            except GpuRefStale as exc:
                conn.send(exc.reason)
        elif kind == "drop":
            held.release()
            held = None
            conn.send("dropped")
        elif kind == "stop":
            conn.send("stopped")
            return
