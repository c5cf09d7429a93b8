"""A producer device on one Ray node, a consumer device on another, a restart of the producer
mid-run, every batch verified (host driver).

    python examples/ray_pipeline.py [--batches N] [--mib X] [--kill-at K]

It starts a local simulated cluster (head + 2 nodes, every node on 127.0.0.2, so no traffic
leaves the loopback range), a ``RayDevice`` on each of the two nodes, and runs ``--batches``
batches: the producer fills a block with the batch's value (``FILL_F32`` on its kernel actor),
the consumer's device receives the bytes (``fetch_to``: node A to node B through Ray's object
store, ordered after the fill), and the driver checks them on B (``fetch``). At batch
``--kill-at`` the producer's Ray actor is killed; Ray restarts it (generation + 1), the batch in
flight fails with ``GpuRefStale`` and is produced again on the new generation. Exit status 0 when
every batch was verified.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing it

import xlog_actors as xa  # noqa: E402 - after the path above
from xlog_actors.errors import DeviceUnavailable, GpuRefStale  # noqa: E402
from xlog_actors.kernels import FILL_F32, launch_shape  # noqa: E402
from xlog_actors.ray import fetch, fetch_to, start_ray_device  # noqa: E402
from xlog_actors.ray.fetch import ray_get  # noqa: E402

LOOPBACK = "127.0.0.2"


def _produce(producer: Any, nbytes: int, value: float) -> Any:
    """A block on the producer's device, filled with ``value`` (answered once enqueued)."""
    src = ray_get(producer.ask.remote(xa.Allocate(nbytes)), "producer", 30)
    n = nbytes // 4
    grid, block = launch_shape(n)
    ray_get(producer.ask.remote(xa.Launch(FILL_F32, grid, block, [xa.Out(src), value, n])), "producer", 30)
    return src


def _produce_on_a_live_device(producer: Any, nbytes: int, value: float, timeout_s: float = 60.0) -> Any:
    """``_produce``, retried while Ray restarts the producer (it has no event for that)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return _produce(producer, nbytes, value)
        except (DeviceUnavailable, GpuRefStale):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _wait_for_restart(producer: Any, old_generation: int, timeout_s: float = 60.0) -> None:
    """Block until Ray has restarted the producer past ``old_generation``: ``ray.kill`` returns
    before the actor is gone, and a fetch that raced ahead of it would read the old block."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ray_get(producer.generation.remote(), "producer", 5) > old_generation:
                return
        except DeviceUnavailable:
            pass  # restarting
        if time.monotonic() > deadline:
            raise DeviceUnavailable(f"producer: not restarted within {timeout_s} s")
        time.sleep(0.01)


def run_pipeline(
    node_a: str, node_b: str, batches: int, nbytes: int, kill_at: int | None, log: Any = print
) -> dict[str, int]:
    """The pipeline on a running cluster: producer on ``node_a``, consumer on ``node_b``.

    Returns:
        ``verified`` (batches whose bytes matched on B), ``redone`` (batches produced again after
        the restart), ``generations`` (the producer's first and last generation differ by this).
    Raises:
        AssertionError: a batch whose bytes do not match.
    """
    import ray

    producer = start_ray_device(0, node_id=node_a, max_restarts=2)
    consumer = start_ray_device(0, node_id=node_b, max_restarts=0)
    try:
        first = ray_get(producer.generation.remote(), "producer", 60)
        dst = ray_get(consumer.ask.remote(xa.Allocate(nbytes)), "consumer", 60)
        verified = redone = 0
        for i in range(batches):
            value = float(i) + 0.5
            src = _produce_on_a_live_device(producer, nbytes, value)
            if kill_at == i:
                t0 = time.monotonic()
                ray.kill(producer, no_restart=False)
                log(f"batch {i}: producer killed (generation {src.generation}); the batch in flight is lost")
                _wait_for_restart(producer, src.generation)
            try:
                fetch_to(src, consumer, dst)
            except (GpuRefStale, DeviceUnavailable) as exc:
                # The read met the restart: the new device refuses the old generation, or Ray
                # reports the old actor gone.
                assert kill_at == i, f"batch {i}: {exc}"
                src = _produce_on_a_live_device(producer, nbytes, value)
                fetch_to(src, consumer, dst)
                redone += 1
                log(f"batch {i}: produced again on generation {src.generation}, "
                    f"{time.monotonic() - t0:.2f} s after the kill ({type(exc).__name__}: {exc})")
            got = fetch(dst)
            assert np.array_equal(got.view(np.float32), np.full(nbytes // 4, value, np.float32)), f"batch {i}"
            verified += 1
            ray_get(producer.ask.remote(xa.Free(src)), "producer", 30)
        last = ray_get(producer.generation.remote(), "producer", 30)
        return {"verified": verified, "redone": redone, "generations": last - first}
    finally:
        ray.kill(producer, no_restart=True)
        ray.kill(consumer, no_restart=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--mib", type=float, default=4.0, help="bytes per batch, in MiB")
    parser.add_argument("--kill-at", type=int, default=10, help="the batch at which the producer is killed (-1: never)")
    args = parser.parse_args(argv)
    import ray
    from ray.cluster_utils import Cluster

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    t0 = time.monotonic()
    sim = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": LOOPBACK,
                                                        "include_dashboard": False})
    try:
        a = sim.add_node(num_cpus=1, node_ip_address=LOOPBACK)
        b = sim.add_node(num_cpus=1, node_ip_address=LOOPBACK)
        ray.init(address=sim.address, log_to_driver=False)
        sim.wait_for_nodes()
        print(f"cluster: head + 2 nodes on {LOOPBACK}, up in {time.monotonic() - t0:.1f} s")
        nbytes = int(args.mib * (1 << 20)) // 4 * 4
        t1 = time.monotonic()
        out = run_pipeline(a.node_id, b.node_id, args.batches, nbytes, None if args.kill_at < 0 else args.kill_at)
        print(f"{out['verified']}/{args.batches} batches of {nbytes} bytes verified on node B in "
              f"{time.monotonic() - t1:.1f} s; {out['redone']} produced again after "
              f"{out['generations']} producer restart(s)")
        return 0 if out["verified"] == args.batches else 1
    finally:
        ray.shutdown()
        sim.shutdown()


if __name__ == "__main__":
    sys.exit(main())
