"""Several GPUs: the demo on two at once in both placements, the demo surviving a sticky error on
one of them (isolated), and a DevicePool over two; marked
``gpu`` and skipped with the reason on fewer than two GPUs (the host-driver versions are in
test_multi_demo.py and tests/actors/test_device_pool.py)."""

from __future__ import annotations

import pytest

import xlog_actors as xa
from xlog_actors.cli.multi_pipeline import InjectedFault, run_on_devices
from xlog_actors.cli.pipeline import PipelineConfig

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("placement", ["isolated", "in-process"])
def test_the_demo_on_two_gpus_verifies_every_batch(cuda_pair: xa.Driver, placement: str) -> None:
    cfg = PipelineConfig(batches=32, batch_bytes=1 << 20, depth=4)
    result = run_on_devices("cuda", 2, cfg, placement, cuda_pair)  # type: ignore[arg-type]
    assert result.ok, [(r.ordinal, r.error, r.result.errors if r.result else None) for r in result.runs]
    assert [r.result.verified for r in result.runs if r.result is not None] == [32, 32]
    assert result.throughput_bytes_s > 0


def test_a_sticky_error_on_one_gpu_restarts_its_worker_and_every_batch_is_verified(cuda_pair: xa.Driver) -> None:
    """A real CUDA_ERROR_ILLEGAL_ADDRESS on GPU 1 at its batch 12: its worker process ends, a new one
    runs the batches not verified; GPU 0 is untouched; every batch of both verified once. (Isolated
    only: in this process a poisoned context would stay poisoned for the tests after.)"""
    cfg = PipelineConfig(batches=32, batch_bytes=1 << 20, depth=4)
    result = run_on_devices("cuda", 2, cfg, "isolated", fault=InjectedFault(1, 12))
    first, second = result.runs
    assert result.ok, [(r.ordinal, r.error, r.faults, r.result.errors if r.result else None) for r in result.runs]
    assert (first.restarts, second.restarts) == (0, 1)
    assert "ILLEGAL_ADDRESS" in second.faults[0] or "oison" in second.faults[0], second.faults
    assert second.result is not None and second.result.verified == 32
    by_worker = second.result.extra["verified_by_worker"]
    assert sum(by_worker) == 32 and by_worker[0] <= 12, by_worker


def test_a_device_pool_over_two_gpus_uses_both(cuda_pair: xa.Driver) -> None:
    pool = xa.DevicePool.start(2, cuda_pair)
    refs = [pool.allocate(1 << 20) for _ in range(4)]
    assert sorted(r.device_id for r in refs) == [0, 0, 1, 1]
    assert [m.outstanding_bytes for m in pool.members()] == [2 << 20, 2 << 20]
    assert pool.devices[1].ask(xa.Rebuild("test")) == 1
    assert pool.wait_serving(1, 30.0).status == "serving"
    pool.stop()
