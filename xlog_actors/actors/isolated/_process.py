"""``ChildProcess``: a spawned child process of an isolated device and the parent's end of its pipe.

Invariants:

* A child is spawned (never forked: the parent's threads and driver state must not be copied),
  as a daemon, so it never outlives the parent.
* The parent closes its copy of the child's end of the pipe at once: the child's death must end
  the parent's reads (``EOFError``), which is how the reader learns of it.
* A child serves only after the boot handshake: ``("booted", t)`` when its interpreter is up,
  then the parent's ``config`` frame, then ``("ready", ...)`` or ``("failed", error)``, all within
  ``READY_TIMEOUT_S``. A spawned process that was never configured (the reserve a restart takes)
  holds no driver, so ending it is a kill.
* Ending a configured child asks it to stop first (it closes its driver) and kills it only past
  the timeout.

Thread rules: a ``ChildProcess`` is made, configured and ended on the proxy's thread (the first
one on the thread that starts the proxy); the pipe's ``Channel`` is then read by the child's reader
thread only, and sent on from any thread.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

from ...errors import DeviceUnavailable
from ._protocol import Channel, child_entry, decode_error

__all__ = ["READY_TIMEOUT_S", "STOP_TIMEOUT_S", "ChildProcess"]

#: How long a child may take from its configuration to serving (a first CUDA initialisation
#: takes seconds); past it the child is killed and the start or restart fails.
READY_TIMEOUT_S = 60.0
#: How long ``stop()`` waits for a child to end by itself before it kills it.
STOP_TIMEOUT_S = 10.0
_CHILD_MODULE = "xlog_actors.actors.isolated._child"
_SPAWN = multiprocessing.get_context("spawn")


class ChildProcess:
    """A spawned child process and the parent's end of its pipe.

    Thread rule: the proxy's thread; ``channel.send`` from any thread.
    """

    def __init__(self, ordinal: int) -> None:
        """Spawn the child of device ``ordinal``; it boots (imports) while the parent goes on.

        Args:
            ordinal: the device ordinal (names the process).
        """
        parent_end, child_end = _SPAWN.Pipe()
        self.process = _SPAWN.Process(
            target=child_entry, args=(child_end, _CHILD_MODULE), name=f"xlog-device-{ordinal}", daemon=True
        )
        self.spawned = time.monotonic()
        self.process.start()
        child_end.close()  # the child's death must end the parent's reads
        self.channel = Channel(parent_end)

    def await_ready(self, ordinal: int) -> tuple[float | None, tuple[Any, ...]]:
        """Wait for the configured child to serve: when it booted (None if it did not say) and
        its ``ready`` frame.

        Raises:
            DeviceUnavailable: it did not serve within ``READY_TIMEOUT_S`` or exited first.
            XlogError: the error its configuration failed with.
        """
        deadline = time.monotonic() + READY_TIMEOUT_S
        booted: float | None = None
        where = f"isolated device {ordinal}: process {self.process.pid}"
        while True:
            if not self.channel.poll(max(0.0, deadline - time.monotonic())):
                raise DeviceUnavailable(f"{where} did not serve within {READY_TIMEOUT_S} s")
            try:
                frame = self.channel.recv()
            except (EOFError, OSError):
                self.process.join(5.0)
                raise DeviceUnavailable(
                    f"{where} exited with code {self.process.exitcode} before it served"
                ) from None
            if frame[0] == "booted":
                booted = frame[1]
            elif frame[0] == "ready":
                return booted, frame
            elif frame[0] == "failed":
                raise decode_error(frame[1])

    def discard(self) -> None:
        """End a reserve that was never configured: it holds no driver, so it is killed."""
        self.process.kill()
        self.process.join()
        self.channel.close()

    def end(self, timeout: float) -> int | None:
        """Ask the process to stop, wait ``timeout`` s, then kill it; its exit code."""
        try:
            self.channel.send(("stop",))
        except (OSError, ValueError):
            pass  # already gone
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.channel.close()
        return self.process.exitcode
