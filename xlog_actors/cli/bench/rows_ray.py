"""The Ray rows, run only with ``xlog-actors bench --ray``: a simulated three-node
cluster (head + A + B, every node on 127.0.0.2; about 10 s to start) with host-driver devices in
its workers, whatever driver the rest of the run uses (Ray does not run on the GPU machine).

Rows: the local path (a ``SlabClient`` beside a local ``DeviceClient``), a cross-node fetch of
64 MiB beside a plain Ray object transfer of the same bytes (into B's device, and to the caller),
and a killed device actor's restart to its first allocation. Where ray is not installed every row
is skipped with the reason.

Invariants: the cluster, its devices and actors exist only inside the group's base setup and are
shut down when it is left. Thread rule: the bench's thread.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...actors import Allocate, DeviceActor, GetClient, Rebuild
from ...errors import DeviceUnavailable
from .harness import Context, Group, Op, Row, SkipRow, given
from .plan import MIB, SIZE, Plan
from .result import Target

__all__ = ["FETCH_BYTES", "LOOPBACK", "RAY"]

#: The address every node binds to: Ray rewrites 127.0.0.1 to the machine's routable address and
#: keeps any other loopback address, so no traffic leaves the loopback range.
LOOPBACK = "127.0.0.2"
#: The bytes of one fetch: 64 MiB, large enough that the transfer's bandwidth, not a call's fixed cost, dominates.
FETCH_BYTES = 64 * MIB


class _Producer:
    """On A: hands out the same array each call (what a plain Ray transfer sends)."""

    def __init__(self, nbytes: int) -> None:
        self._data = np.arange(nbytes, dtype=np.uint8)

    def give(self) -> np.ndarray:
        return self._data


class _Sink:
    """On B: takes an array through Ray's object store."""

    def take(self, data: np.ndarray) -> int:
        return int(data.nbytes)


@dataclass
class _Cluster:
    ray: Any
    cluster: Any
    head: Any  # the devices, Ray actor handles
    a: Any
    b: Any
    src: Any  # FETCH_BYTES on A, and a block as large on B
    dst: Any
    producer: Any
    sink: Any
    local: Any  # a pykka device in this process, ctx.driver's
    restarts: int


@contextlib.contextmanager
def _cluster(ctx: Context) -> Iterator[_Cluster | None]:
    try:
        import ray
        from ray.cluster_utils import Cluster
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    except ImportError:
        yield None
        return
    from ...ray import start_ray_device

    root = str(Path(__file__).resolve().parents[3])
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "RAY_AUTH_MODE")}
    # The workers inherit the raylets' environment: they import this checkout.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, saved["PYTHONPATH"]) if p)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    sim: Any = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": LOOPBACK,
                                                        "include_dashboard": False})
    local = None
    try:
        node_a = sim.add_node(num_cpus=1, node_ip_address=LOOPBACK)
        node_b = sim.add_node(num_cpus=1, node_ip_address=LOOPBACK)
        ray.init(address=sim.address, log_to_driver=False)
        sim.wait_for_nodes()
        head = ray.get_runtime_context().get_node_id()

        def on(node: str) -> Any:
            return NodeAffinitySchedulingStrategy(node_id=node, soft=False)

        devices = [start_ray_device(0, node_id=n, max_restarts=100) for n in (head, node_a.node_id, node_b.node_id)]
        src = ray.get(devices[1].ask.remote(Allocate(FETCH_BYTES)), timeout=60)
        ray.get(devices[1].write.remote(src, np.arange(FETCH_BYTES, dtype=np.uint8)), timeout=60)
        dst = ray.get(devices[2].ask.remote(Allocate(FETCH_BYTES)), timeout=60)
        producer = ray.remote(_Producer).options(num_cpus=0, scheduling_strategy=on(node_a.node_id))
        sink = ray.remote(_Sink).options(num_cpus=0, scheduling_strategy=on(node_b.node_id))
        local = DeviceActor.start(0, ctx.driver)
        restarts = 3 if ctx.plan.min_samples <= 5 else 5
        yield _Cluster(ray, sim, devices[0], devices[1], devices[2], src, dst, producer.remote(FETCH_BYTES),
                       sink.remote(), local, restarts)
    finally:
        if local is not None:
            local.stop()
        ray.shutdown()
        sim.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _need(f: _Cluster | None) -> _Cluster:
    if f is None:
        raise SkipRow("ray is not installed (pip install 'xlog-actors[ray]')")
    return f


# -- the local path --------------------------------------------------------------------------------
def _slab(f: _Cluster | None) -> Op:
    from ...ray import SlabClient

    client = SlabClient(_need(f).head, slab_bytes=64 * MIB)
    client.free(client.allocate(SIZE))  # the one reservation, before the timing
    allocate, free = client.allocate, client.free

    def ours(n: int) -> None:
        for _ in range(n):
            free(allocate(SIZE))

    return ours


def _device_client(f: _Cluster | None) -> Op:
    client = _need(f).local.ask(GetClient())
    allocate, free = client.allocate, client.free

    def twin(n: int) -> None:
        for _ in range(n):
            free(allocate(SIZE))

    return twin


# -- the fetch -------------------------------------------------------------------------------------
def _fetch(f: _Cluster | None) -> Op:
    from ...ray import fetch_to

    c = _need(f)

    def ours(n: int) -> None:
        for _ in range(n):
            fetch_to(c.src, c.b, c.dst)

    return ours


def _plain_transfer(f: _Cluster | None) -> Op:
    c = _need(f)
    get = c.ray.get

    def twin(n: int) -> None:
        for _ in range(n):
            assert get(c.sink.take.remote(c.producer.give.remote()), timeout=60) == FETCH_BYTES

    return twin


def _fetch_here(f: _Cluster | None) -> Op:
    from ...ray import fetch

    c = _need(f)

    def ours(n: int) -> None:
        for _ in range(n):
            fetch(c.src)

    return ours


def _plain_get(f: _Cluster | None) -> Op:
    c = _need(f)
    get = c.ray.get

    def twin(n: int) -> None:
        for _ in range(n):
            get(c.producer.give.remote(), timeout=60)

    return twin


def _fetched_right(f: _Cluster | None) -> None:
    from ...ray import fetch

    c = _need(f)
    if not np.array_equal(fetch(c.dst), np.arange(FETCH_BYTES, dtype=np.uint8)):
        raise RuntimeError("the bytes fetched to B differ from A's")


# -- the restart -----------------------------------------------------------------------------------
def _restarts(f: _Cluster | None, ctx: Context) -> tuple[list[float], list[float]]:
    """``ray.kill(no_restart=False)`` of A's device to its first allocation on generation + 1,
    ``f.restarts`` times (retried: Ray has no event for it); the reference is an in-process
    ``Rebuild`` of a local device."""
    c = _need(f)
    ray = c.ray
    ours: list[float] = []
    ref: list[float] = []
    for _ in range(c.restarts):
        generation = ray.get(c.a.generation.remote(), timeout=60)
        t0 = time.perf_counter_ns()
        ray.kill(c.a, no_restart=False)
        while _generation_of_an_allocation(c) != generation + 1:
            if time.perf_counter_ns() - t0 > 60e9:
                raise DeviceUnavailable("the killed device actor did not serve a new generation in 60 s")
            time.sleep(0.005)
        ours.append(float(time.perf_counter_ns() - t0))
        r0 = time.perf_counter_ns()
        c.local.ask(Rebuild("bench"))
        ref.append(float(time.perf_counter_ns() - r0))
    return ours, ref


def _generation_of_an_allocation(c: _Cluster) -> int | None:
    """The generation of an allocation on A, or None while Ray says the actor is restarting."""
    ray = c.ray
    try:
        return int(ray.get(c.a.ask.remote(Allocate(SIZE)), timeout=60).generation)
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
        return None


def _restart_note(f: _Cluster | None, plan: Plan) -> str:
    n = f.restarts if f is not None else 0
    return f"median of {n} kills; the first allocation is retried every 5 ms until the new generation answers"


RAY = Group("ray (simulated cluster, --ray)", (
    Row("ray local path allocate", "SlabClient.allocate(4 KiB) + free beside the device's node (one Ray call "
        "reserved a 64 MiB slab; no Ray call per allocation)", given, _slab, _device_client,
        lambda p: p.client, reference="local DeviceClient allocate + free (in-process pykka device)",
        target=Target("ratio", "<=", 1.5)),
    Row("ray fetch 64 MiB", "fetch_to: A's block into a block on B (keeper lookup, read after the last write, "
        "the object store A -> B, the copy in on B)", given, _fetch, _plain_transfer,
        lambda p: (5 if p.min_samples <= 5 else 12, 1), reference="plain Ray transfer: an actor on A returns "
        "64 MiB, an actor on B takes it", kind="rate", bytes_per_op=FETCH_BYTES,
        target=Target("ratio", ">=", 0.8), check=_fetched_right),
    Row("ray fetch 64 MiB to the caller", "fetch: A's block to this process on the head node (keeper lookup, read "
        "after the last write, the object store A -> head); no copy into a device", given, _fetch_here, _plain_get,
        lambda p: (5 if p.min_samples <= 5 else 12, 1), reference="plain ray.get of 64 MiB an actor on A returns",
        kind="rate", bytes_per_op=FETCH_BYTES, note="informational: the fetch row without the consumer's device copy"),
    Row("ray restart to first Allocate", "ray.kill(no_restart=False) of a RayDevice to its first allocation on "
        "generation + 1", given, None, None, lambda p: (1, 1), measure=_restarts,
        reference="in-process Rebuild round trip", target=Target("median", "<=", 3e6), note=_restart_note),
), base=_cluster)
