"""A Ray device on the CUDA driver, end to end, on a simulated three-node cluster of one GPU host:
allocate on node A (the GPU node), write, read on node B through the fetch, kill the device
actor, see the generation go up and the old handle fail on B. Prints each step's time.

    python scripts/ray_cuda_smoke.py        (needs ray and a GPU)
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import numpy as np
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import xlog_actors as xa
from xlog_actors.driver import open_driver
from xlog_actors.ray import fetch, start_ray_device

LOOPBACK = "127.0.0.2"


def _read_on_node(ref: Any) -> bytes:
    return fetch(ref).tobytes()


def _stale_on_node(ref: Any) -> str:
    try:
        fetch(ref)
    except xa.GpuRefStale as exc:
        return f"GpuRefStale: {exc}"
    return "not stale"


def main() -> None:
    os.environ["RAY_AUTH_MODE"] = "disabled"
    t0 = time.monotonic()
    sim = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "num_gpus": 0, "node_ip_address": LOOPBACK, "include_dashboard": False})
    a = sim.add_node(num_cpus=1, num_gpus=1, node_ip_address=LOOPBACK)
    b = sim.add_node(num_cpus=1, num_gpus=0, node_ip_address=LOOPBACK)
    ray.init(address=sim.address, log_to_driver=True)
    sim.wait_for_nodes()
    print(f"cluster up in {time.monotonic() - t0:.1f} s")
    on_b = NodeAffinitySchedulingStrategy(node_id=b.node_id, soft=False)
    try:
        dev = start_ray_device(0, node_id=a.node_id, driver_factory=functools.partial(open_driver, "cuda"),
                               num_gpus=1, max_restarts=1)
        t = time.monotonic()
        ref = ray.get(dev.ask.remote(xa.Allocate(1 << 20)), timeout=120)
        print(f"first Allocate on the CUDA device: {time.monotonic() - t:.2f} s; {ref!r}")
        data = np.arange(1 << 18, dtype=np.float32)
        ray.get(dev.write.remote(ref, data), timeout=60)
        got = ray.get(ray.remote(_read_on_node).options(num_cpus=0, scheduling_strategy=on_b).remote(ref), timeout=60)
        print("read on B matches:", got == data.tobytes())
        gen = ray.get(dev.generation.remote(), timeout=30)
        t = time.monotonic()
        ray.kill(dev, no_restart=False)
        while True:
            try:
                if ray.get(dev.generation.remote(), timeout=5) == gen + 1:
                    break
            except Exception:  # noqa: BLE001 - restarting
                time.sleep(0.05)
        fresh = ray.get(dev.ask.remote(xa.Allocate(4096)), timeout=60)
        print(f"killed -> first Allocate on generation {fresh.generation}: {time.monotonic() - t:.2f} s")
        print("old handle on B:", ray.get(ray.remote(_stale_on_node).options(num_cpus=0, scheduling_strategy=on_b)
                                          .remote(ref), timeout=60))
        ray.kill(dev, no_restart=True)
    finally:
        ray.shutdown()
        sim.shutdown()


if __name__ == "__main__":
    main()
