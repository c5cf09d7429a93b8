"""The consumer process of the cross-process read row (:mod:`.rows_shared`): it opens a handle
another process sent it and reads it, and reads a block of its own the same way, timing each
read itself so the pipe's round trip is in neither figure.

Commands (tuples over the pipe, one reply each):

* ``("open", ref, per_sync)``: ``ref`` arrives as a ``SharedGpuRef``; make a local block of the
  same size and a destination; reply ``"ready"``;
* ``("read", which, n)``: ``which`` is ``"imported"`` or ``"local"``; ``n`` rounds of
  ``per_sync`` copies of the whole block into the destination, then a synchronize; reply the
  elapsed nanoseconds;
* ``("check",)``: read the imported block once, reply the first 16 bytes the destination holds;
* ``("stop",)``: free everything, reply ``"stopped"`` and return.

On CUDA a copy is ``driver.copy_device_to_device`` (``cuMemcpyDtoDAsync``) on one stream of the
consumer's own context, from the imported address or from its own ``cuMemAlloc`` block; on the
host driver ``numpy.copyto`` from the shared-memory view or from private memory.

Thread rule: one thread, the process's main one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ...driver.open import DriverChoiceKind, open_driver

__all__ = ["serve"]


def serve(conn: Connection, kind: DriverChoiceKind) -> None:
    """Serve the commands of the module docstring until ``"stop"`` or the end of the pipe.

    Args:
        conn: this end of the pipe.
        kind: the driver kind of the owner (``"cuda"`` or ``"host"``).
    Thread rule: the process's main thread.
    """
    driver = open_driver(kind)
    cleanup: list[Callable[[], None]] = [driver.close]
    read: dict[str, Callable[[int], None]] = {}
    check: Callable[[], bytes] = lambda: b""  # noqa: E731 - replaced by "open"
    try:
        while True:
            try:
                cmd = conn.recv()
            except (EOFError, OSError):
                return
            if cmd[0] == "open":
                read, check = _open(driver, cmd[1], cmd[2], cleanup)
                conn.send("ready")
            elif cmd[0] == "read":
                fn = read[cmd[1]]
                t0 = time.perf_counter_ns()
                fn(cmd[2])
                conn.send(time.perf_counter_ns() - t0)
            elif cmd[0] == "check":
                read["imported"](1)
                conn.send(check())
            else:
                conn.send("stopped")
                return
    finally:
        for undo in reversed(cleanup):
            undo()


def _open(
    driver: Any, ref: Any, per_sync: int, cleanup: list[Callable[[], None]]
) -> tuple[dict[str, Callable[[int], None]], Callable[[], bytes]]:
    nbytes = ref.nbytes
    cleanup.append(ref.release)
    if driver.kind == "cuda":
        imported = ref.raw_device_ptr()
        local, dst = driver.alloc(0, nbytes), driver.alloc(0, nbytes)
        stream = driver.create_stream(0)
        cleanup.extend([lambda: driver.free(0, local), lambda: driver.free(0, dst), stream.close])

        def reader(src: int) -> Callable[[int], None]:
            def run(n: int) -> None:
                for _ in range(n):
                    for _ in range(per_sync):
                        driver.copy_device_to_device(dst, src, nbytes, stream)
                    stream.synchronize()

            return run

        def check() -> bytes:
            return bytes(driver.copy_to_host(dst, 16, stream))

        return {"imported": reader(imported), "local": reader(local)}, check
    view = np.frombuffer(ref.view(), np.uint8)
    own = np.ones(nbytes, np.uint8)
    out = np.empty(nbytes, np.uint8)

    def host_reader(src: np.ndarray) -> Callable[[int], None]:
        def run(n: int) -> None:
            for _ in range(n * per_sync):
                np.copyto(out, src)

        return run

    return {"imported": host_reader(view), "local": host_reader(own)}, lambda: out[:16].tobytes()
