"""One simulated three-node Ray cluster for the whole test session (head + nodes A and B).

Started by the first test that asks for it (about 7 s on a 2-core host), so its start-up is paid
once; skipped with a reason where ray is not installed. Every node binds to 127.0.0.2: Ray
rewrites 127.0.0.1 (and localhost) to the machine's routable address, while any other loopback
address is kept, so no traffic leaves the loopback range. The test process is the Ray driver, on
the head node; devices run on A, consumers on B.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import xlog_actors as xa

#: The checkout whose xlog_actors the Ray workers must import (not an installed copy elsewhere).
ROOT = str(Path(xa.__file__).resolve().parent.parent)

#: A loopback address Ray keeps as it is (see the module docstring).
LOOPBACK = "127.0.0.2"


@dataclass(frozen=True)
class Nodes:
    """The simulated cluster: ``head`` runs this process (the Ray driver); ``a`` and ``b`` are
    the two other nodes (devices on ``a``, consumers on ``b``)."""

    cluster: Any
    head: str
    a: str
    b: str
    loopback: str = LOOPBACK

    @property
    def device(self) -> str:
        """The node the devices run on (``a``)."""
        return self.a


@pytest.fixture(scope="session")
def cluster() -> Iterator[Nodes]:
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'xlog-actors[ray]')")
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:
        # Workers inherit the environment of the raylets started from this process.
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        mp.setenv("RAY_AUTH_MODE", "disabled")
        sim = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "node_ip_address": LOOPBACK, "include_dashboard": False},
        )
        # A declares one GPU (a logical resource: nothing checks it on a machine without one),
        # so the GPU tests can start a device there with num_gpus=1.
        a = sim.add_node(num_cpus=1, num_gpus=1, node_ip_address=LOOPBACK)
        b = sim.add_node(num_cpus=1, node_ip_address=LOOPBACK)
        ray.init(address=sim.address, log_to_driver=False)
        sim.wait_for_nodes()
    try:
        nodes = Nodes(sim, ray.get_runtime_context().get_node_id(), a.node_id, b.node_id)
        assert len({nodes.head, nodes.a, nodes.b}) == 3
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {LOOPBACK}
        yield nodes
    finally:
        ray.shutdown()
        sim.shutdown()
