"""PyTorch and CuPy allocating through a device on the GPU: results equal to their own
allocators', a budget refusal raised in their calls with our report, the tag back to zero, and
what a rebuild does. Each scenario runs in a fresh process (``alloc_scenarios.py`` says why)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from xlog_actors.cli.bench.training_session import run_half

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = Path(__file__).resolve().parent / "alloc_scenarios.py"


def _run(library: str, name: str, *args: str) -> None:
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed (an optional extra)")
    if os.environ.get("XLOG_ACTORS_SANITIZER") == "1":
        # A fresh process that initialises torch or CuPy takes minutes under the tool; the plain
        # GPU run covers these scenarios.
        pytest.skip(f"{library} in a fresh process under compute-sanitizer: run in the plain GPU run")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(SCENARIOS), name, *args], check=False, capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"{name}{args}: exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "held" in proc.stdout


@pytest.mark.gpu
def test_a_torch_model_through_the_device_equals_torch_s_own_allocator(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "device.npz", tmp_path / "torch.npz"
    _run("torch", "torch_model", "device", str(ours))
    _run("torch", "torch_model", "torch", str(theirs))
    a, b = np.load(ours), np.load(theirs)
    assert sorted(a.files) == sorted(b.files) and len(a.files) == 7  # the loss and 6 gradients
    for name in a.files:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.gpu
def test_a_torch_allocation_over_budget_raises_in_torch_with_our_report() -> None:
    _run("torch", "torch_budget_refusal")


@pytest.mark.gpu
def test_a_rebuild_under_live_tensors_is_reported_and_torch_goes_on() -> None:
    _run("torch", "torch_rebuild")


@pytest.mark.gpu
def test_torch_s_freed_blocks_come_back_from_the_bridge_s_cache_on_their_stream() -> None:
    _run("torch", "torch_cache")


@pytest.mark.gpu
def test_the_report_shows_torch_s_cached_share_and_the_limit_bounds_it() -> None:
    _run("torch", "torch_cache_share_and_limit")


@pytest.mark.gpu
def test_cupy_arrays_come_from_the_device_and_restore_puts_cupy_back() -> None:
    _run("cupy", "cupy_arrays")


@pytest.mark.gpu
def test_a_cupy_allocation_over_budget_raises_our_budget_error() -> None:
    _run("cupy", "cupy_budget_refusal")


@pytest.mark.gpu
def test_a_rebuild_under_live_cupy_arrays_is_reported_and_cupy_goes_on() -> None:
    _run("cupy", "cupy_rebuild")


@pytest.mark.gpu
@pytest.mark.parametrize("half", ["device", "torch", "null"])
def test_both_halves_of_the_training_loop_row_run(half: str) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (an optional extra)")
    if os.environ.get("XLOG_ACTORS_SANITIZER") == "1":
        pytest.skip("torch in a fresh process under compute-sanitizer: run in the plain GPU run")
    doc = run_half(half, 200, 2, timeout_s=300)
    assert len(doc["ns_per_step"]) == 2 and all(x > 0 for x in doc["ns_per_step"])
    assert doc["what"]


@pytest.mark.gpu
def test_the_rmm_half_of_the_peer_row_runs_where_rmm_is_installed() -> None:
    for library in ("torch", "rmm"):
        if importlib.util.find_spec(library) is None:
            pytest.skip(f"{library} is not installed (the RMM peer row skips with this reason too)")
    if os.environ.get("XLOG_ACTORS_SANITIZER") == "1":
        pytest.skip("torch in a fresh process under compute-sanitizer: run in the plain GPU run")
    doc = run_half("rmm", 200, 2, timeout_s=300)
    assert len(doc["ns_per_step"]) == 2 and all(x > 0 for x in doc["ns_per_step"])
    assert "RMM" in doc["what"] and "PoolMemoryResource" in doc["what"]
