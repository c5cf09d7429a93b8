"""What a device behind Ray costs, against the same device asked locally (host driver, one
local Ray instance bound to 127.0.0.2, issue #20 step 1).

    PYTHONPATH=. python scripts/bench_ray.py [--calls N] [--restarts N]

It prints, in one run: the median and p99 of an ``Allocate``+``Free`` pair asked of a local
``DeviceActor`` (pykka) and of a ``RayDevice`` (two Ray calls), a trivial Ray actor call, and the
time from ``ray.kill(no_restart=False)`` of the device's Ray actor to its first successful
allocation on the new generation (the restart is seen only by retrying: Ray has no event for it).
Needs ray (``pip install 'xlog-actors[ray]'``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import ray

import xlog_actors as xa
from xlog_actors.ray import start_ray_device


def _timed(fn: Callable[[], object], n: int) -> tuple[float, float]:
    """Median and p99 of ``n`` calls of ``fn``, in µs (after 20 unmeasured ones)."""
    for _ in range(20):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return statistics.median(times), times[int(0.99 * (len(times) - 1))]


class _Echo:
    def ping(self) -> int:
        return 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--restarts", type=int, default=5)
    args = parser.parse_args()
    root = str(Path(xa.__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.2", log_to_driver=False)
    print(f"ray.init: {time.perf_counter() - t0:.2f} s (ray {ray.__version__})")

    local = xa.DeviceActor.start(ordinal=0, driver=xa.HostDriver())

    def local_pair() -> None:
        local.ask(xa.Free(local.ask(xa.Allocate(256))))

    med, p99 = _timed(local_pair, args.calls)
    print(f"local pykka Allocate+Free: median {med:.0f} µs, p99 {p99:.0f} µs")

    device = start_ray_device(0, max_restarts=args.restarts + 1)

    def ray_pair() -> None:
        ref = ray.get(device.ask.remote(xa.Allocate(256)))
        ray.get(device.ask.remote(xa.Free(ref)))

    med_r, p99_r = _timed(ray_pair, args.calls)
    print(f"RayDevice Allocate+Free (2 Ray calls): median {med_r:.0f} µs, p99 {p99_r:.0f} µs ({med_r / med:.1f}x)")

    echo = ray.remote(_Echo).options(num_cpus=0).remote()
    med_e, p99_e = _timed(lambda: ray.get(echo.ping.remote()), args.calls)
    print(f"trivial Ray actor call: median {med_e:.0f} µs, p99 {p99_e:.0f} µs")
    med_g, p99_g = _timed(lambda: ray.get(device.generation.remote()), args.calls)
    print(f"RayDevice.generation() (a Ray call, no pykka hop): median {med_g:.0f} µs, p99 {p99_g:.0f} µs")

    restarts = []
    for _ in range(args.restarts):
        generation = ray.get(device.generation.remote())
        ray.kill(device, no_restart=False)
        t0 = time.perf_counter()
        while True:
            try:
                ref = ray.get(device.ask.remote(xa.Allocate(256)))
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
                time.sleep(0.005)
                continue
            if ref.generation == generation + 1:
                break
            time.sleep(0.005)
        restarts.append(time.perf_counter() - t0)
    print(
        f"restart to first allocation on the new generation: median {statistics.median(restarts):.2f} s, "
        f"max {max(restarts):.2f} s (of {len(restarts)})"
    )
    local.stop()
    ray.shutdown()


if __name__ == "__main__":
    main()
