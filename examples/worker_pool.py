"""A worker pool in three processes that survives an illegal-address kernel (walked through in
docs/user-guide.md, "Surviving a sticky error").

    python examples/worker_pool.py [--driver host|cuda] [--batches N] [--fault-after K]

Three kinds of process: the parent (this one) holds an isolated device's ``ActorRef``; the device
process (its child, started by ``DeviceActor.start(0, ..., isolate=True)``) holds the memory;
two spawned workers take batches. Per batch the parent allocates a ``GpuRef``, writes the
batch's input into it through the device's ``CopyActor`` (which runs in the device process, next
to the memory) and puts the handle on a ``multiprocessing`` queue; a worker opens it (a
``SharedGpuRef``: the same memory, no copy; the copy's write travels with it, so the worker waits
for exactly that write), checks the input, doubles it in place and answers; the parent then reads
the doubled values back through the ``CopyActor`` and checks them. After ``--fault-after`` verified batches the parent
has a kernel write an illegal address in the device process: that process dies, a new one
serves generation 1, every handle of generation 0 raises ``GpuRefStale`` wherever it is, and the
batches that were in flight are redone on new handles. Exit status 0 when every batch was
verified; the last line is the summary.

The workers touch the bytes through an imported handle: on the host driver its ``view()``, on
the GPU its address with ``cuMemcpy``. On the GPU the device runs the ``direct`` stack, whose
memory is IPC-capable.
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing it

import xlog_actors as xa  # noqa: E402 - after the path above
from xlog_actors.actors.isolated import ChildFault  # noqa: E402

N = 1 << 14  # float32 values per batch
WINDOW = 4  # batches in flight at once
TIMEOUT_S = 30.0  # every wait has one


def batch_input(batch: int) -> np.ndarray:
    return np.arange(N, dtype=np.float32) + batch


def read(handle: Any) -> np.ndarray:
    """The handle's values, after its last exported write (a ``SharedGpuRef``, either driver)."""
    values: np.ndarray
    if handle.export.driver == "host":
        values = np.frombuffer(handle.view(timeout_s=TIMEOUT_S), np.float32).copy()
    else:
        from cuda.bindings import driver as cu

        handle.wait_write(timeout_s=TIMEOUT_S)
        values = np.empty(N, np.float32)
        (err,) = cu.cuMemcpyDtoH(values, handle.raw_device_ptr(), values.nbytes)
        assert err == cu.CUresult.CUDA_SUCCESS, err
    handle.access()  # raises GpuRefStale if the device restarted while we read
    return values


def write(handle: Any, values: np.ndarray) -> None:
    """Write ``values`` into the handle's memory; done when this returns."""
    if handle.export.driver == "host":
        np.frombuffer(handle.view(timeout_s=TIMEOUT_S), np.float32)[:] = values
    else:
        from cuda.bindings import driver as cu

        (err,) = cu.cuMemcpyHtoD(handle.raw_device_ptr(), values, values.nbytes)
        assert err == cu.CUresult.CUDA_SUCCESS, err
        (err,) = cu.cuCtxSynchronize()
        assert err == cu.CUresult.CUDA_SUCCESS, err
    handle.access()


def worker(tasks: Any, results: Any) -> None:
    """A worker process: take ``(batch, pickled handle)`` until ``None``; check, double, answer."""
    while (task := tasks.get(timeout=TIMEOUT_S)) is not None:
        batch, pickled = task
        handle = None
        try:
            handle = pickle.loads(pickled)  # a SharedGpuRef: the device process's memory
            values = read(handle)
            if not np.array_equal(values, batch_input(batch)):
                results.put((batch, "bad input"))
                continue
            write(handle, values * 2)
            results.put((batch, "ok"))
        except (xa.GpuRefStale, xa.DeviceUnavailable) as exc:  # the device process died: redo
            results.put((batch, type(exc).__name__))
        finally:
            if handle is not None:
                handle.release()  # the device process may free it once no process holds it


def run(driver: str, batches: int, fault_after: int) -> dict[str, Any]:
    resource = "direct" if driver == "cuda" else None  # the GPU's default pool is not IPC-capable
    device: Any = xa.DeviceActor.start(0, driver, resource=resource, isolate=True)  # its ask answers Any
    copier: Any = xa.CopyActor.start(device)  # runs in the device process
    ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA
    tasks, results = ctx.Queue(), ctx.Queue()
    workers = [ctx.Process(target=worker, args=(tasks, results), name=f"worker-{i}") for i in range(2)]
    for w in workers:
        w.start()
    pending = deque(range(batches))
    in_flight: dict[int, Any] = {}  # batch -> its GpuRef
    verified, redone, restart_s = 0, 0, None
    fault_at: float | None = None
    try:
        while verified < batches:
            while pending and len(in_flight) < WINDOW:
                batch = pending.popleft()
                try:
                    ref = device.ask(xa.Allocate(4 * N, tag=xa.AllocTag("batch")), timeout=TIMEOUT_S)
                    if fault_at is not None and restart_s is None:
                        restart_s = time.monotonic() - fault_at  # the first allocation of the new process
                    copier.ask(xa.CopyToDevice(ref, batch_input(batch)), timeout=TIMEOUT_S)
                    # Pickled here, not in the queue's feeder thread: a handle that went stale
                    # meanwhile would be dropped there with only a traceback on stderr.
                    tasks.put((batch, pickle.dumps(ref)))
                except (xa.GpuRefStale, xa.DeviceUnavailable):  # the device process died under it: retry
                    pending.appendleft(batch)
                    continue
                in_flight[batch] = ref
            batch, outcome = results.get(timeout=TIMEOUT_S)
            ref = in_flight.pop(batch)
            ok = False
            try:
                if outcome == "ok":
                    doubled = np.frombuffer(copier.ask(xa.CopyToHost(ref), timeout=TIMEOUT_S), np.float32)
                    ok = np.array_equal(doubled, batch_input(batch) * 2)
            except (xa.GpuRefStale, xa.DeviceUnavailable):
                pass  # answered before the fault, checked after: the memory is gone
            if not ok and outcome == "bad input":
                raise RuntimeError(f"batch {batch}: the worker read the wrong input")
            ref.release()
            if ok:
                verified += 1
            else:
                redone += 1
                pending.append(batch)
            if verified == fault_after and fault_at is None:
                fault_at = time.monotonic()
                try:  # a kernel in the device process writes address 16: its context is poisoned
                    device.ask(ChildFault("illegal_address"), timeout=TIMEOUT_S)
                except xa.GpuRefStale as exc:
                    print(f"device process died: {exc}")
        generation = device.ask(xa.GetStats(), timeout=TIMEOUT_S).generation
    finally:
        for _ in workers:
            tasks.put(None)
        for w in workers:
            w.join(TIMEOUT_S)
            if w.is_alive():
                w.kill()
        copier.stop()  # an actor's thread would keep this program alive
        device.stop()
    if any(w.exitcode != 0 for w in workers):
        raise RuntimeError(f"a worker failed: exit codes {[w.exitcode for w in workers]}")
    return {"batches": verified, "redone": redone, "generation": generation, "restart_s": restart_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--driver", choices=("host", "cuda"), default="host")
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--fault-after", type=int, default=6, help="verified batches before the fault")
    args = parser.parse_args(argv)
    s = run(args.driver, args.batches, args.fault_after)
    restart = "none" if s["restart_s"] is None else f"{s['restart_s'] * 1000:.0f} ms"
    print(
        f"worker_pool: {s['batches']} batches verified, {s['redone']} redone, "
        f"generation {s['generation']}, restart {restart} (driver {args.driver})"
    )
    return 0


if __name__ == "__main__":  # spawned workers import this module: guard the program
    sys.exit(main())
