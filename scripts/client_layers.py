"""The ``DeviceClient allocate+free`` row taken apart on one device, layer by layer, rounds
interleaved: the raw ``cuda.bindings`` pair, the device's own resource pair, the context's pair
(a handle made and released, its block freed), the client's pair (the bench row's operation),
and a handle made and dropped alone.

    python scripts/client_layers.py [cuda|host] [rounds] [pairs per round]

Prints the median ns per pair of each layer and its difference to the layer below it.

When to use: the bench's ``DeviceClient allocate+free`` row (or ``AsyncCudaResource alloc+free``)
moved and you need to know which layer gained or lost the time; the bench times only the whole
pair. ``host`` runs anywhere, without the raw ``cuda.bindings`` layer.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from xlog_actors.actors import DeviceActor, GetClient
from xlog_actors.actors.gpu_ref import GpuRef
from xlog_actors.cli.bench.twins import cu
from xlog_actors.driver.open import open_driver
from xlog_actors.memory.block import AllocTag, StreamId

SIZE = 4096


def _timed(op: Callable[[int], None], n: int) -> float:
    t = time.perf_counter()
    op(n)
    return (time.perf_counter() - t) / n * 1e9


def main(kind: str, rounds: int, n: int) -> None:
    drv = open_driver(kind)
    device = DeviceActor.start(0, drv)
    client: Any = device.ask(GetClient())
    ctx = client._cell.lifecycle.context
    resource = ctx.runtime
    ops: dict[str, Callable[[int], None]] = {}
    if kind == "cuda":
        driver = cu()
        stream = driver.CUstream(0)

        def raw(k: int) -> None:
            alloc, free = driver.cuMemAllocAsync, driver.cuMemFreeAsync
            for _ in range(k):
                _, p = alloc(SIZE, stream)
                free(p, stream)

        ops["raw cuda.bindings pair"] = raw

    def res(k: int) -> None:
        alloc, free = resource.allocate, resource.deallocate
        for _ in range(k):
            free(alloc(SIZE))

    def context(k: int) -> None:
        alloc, free = ctx.allocate, ctx.free
        for _ in range(k):
            ref = alloc(SIZE, StreamId.DEFAULT, AllocTag.UNTAGGED)
            ref._mark_released()
            free(ref.block)

    def clientpair(k: int) -> None:
        alloc, free = client.allocate, client.free
        for _ in range(k):
            free(alloc(SIZE))

    block = resource.allocate(SIZE)

    def handle(k: int) -> None:
        make = GpuRef._new
        for _ in range(k):
            ref = make(block, ctx)
            ref._mark_released()

    ops.update({"resource pair": res, "context pair (+ handle)": context, "client pair (the row)": clientpair,
                "a handle made and dropped": handle})
    times: dict[str, list[float]] = {name: [] for name in ops}
    try:
        for op in ops.values():
            op(n // 10)  # warm
        for r in range(rounds):
            order = list(ops.items()) if r % 2 == 0 else list(reversed(ops.items()))
            for name, op in order:
                times[name].append(_timed(op, n))
    finally:
        resource.deallocate(block)
        device.stop()
        drv.close()
    previous = None
    for name, ts in times.items():
        med = statistics.median(ts)
        step = "" if previous is None or name.startswith("a handle") else f"  (+{med - previous:.0f} ns)"
        print(f"{name:28s} {med:8.0f} ns{step}   rounds: {', '.join(f'{t:.0f}' for t in ts)}")
        if not name.startswith("a handle"):
            previous = med


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", nargs="?", default="cuda", choices=("cuda", "host"), help="driver (default cuda)")
    parser.add_argument("rounds", nargs="?", type=int, default=10, help="interleaved rounds (default 10)")
    parser.add_argument("pairs", nargs="?", type=int, default=20000, help="pairs per round (default 20000)")
    args = parser.parse_args()
    main(args.kind, args.rounds, args.pairs)
