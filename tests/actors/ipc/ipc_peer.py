"""The other process of the cross-process handle tests: a spawned peer that receives pickled
``GpuRef``s over a pipe and answers what it read or found.

It is a top-level module of its own folder (the test puts the folder on ``sys.path``) because a
spawned process imports its target by module name, and pytest's importlib mode gives test
modules names a child cannot import. It starts no ``DeviceActor``: the handles arrive as
``SharedGpuRef``s.

Commands (tuples): ``("read", ref, ordered, nbytes)`` reads the first bytes at once and answers
them (host driver: through ``view``; CUDA: ``cuMemcpyDtoH`` from ``raw_device_ptr``);
``("interfaces", ref)`` answers what the CUDA exports say; ``("hold", ref)`` keeps the handle;
``("read_held", nbytes)`` reads the held handle as ``read`` does (ordered) and keeps it;
``("access",)`` answers ``"ok"`` or the stale reason of the held handle; ``("drop",)`` releases
the held handle; ``("stop",)`` ends the peer.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

from xlog_actors.errors import GpuRefStale


def _read(ref: Any, ordered: bool, nbytes: int) -> bytes:
    if ref.export.driver == "host":
        return bytes(ref.view(ordered=ordered, timeout_s=10.0)[:nbytes])
    from cuda.bindings import driver as cu

    if ordered:
        ref.wait_write(timeout_s=10.0)
    ptr = ref.raw_device_ptr()  # makes the device's context current on this thread
    out = bytearray(nbytes)
    (err,) = cu.cuMemcpyDtoH(out, ptr, nbytes)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    return bytes(out)


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
            conn.send(_read(ref, ordered, nbytes))
            ref.release()
        elif kind == "interfaces":
            ref = command[1]
            cai = ref.__cuda_array_interface__
            conn.send((cai["data"][0] == ref.raw_device_ptr(), cai["typestr"], cai["shape"], ref.__dlpack_device__()))
            ref.release()
        elif kind == "hold":
            held = command[1]
            conn.send(("held", type(held).__name__))
        elif kind == "read_held":
            conn.send(_read(held, True, command[1]))
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
