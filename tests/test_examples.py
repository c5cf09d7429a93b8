"""The user guide's walk-through, ``examples/worker_pool.py``, run as a user runs it: a program
in a subprocess whose exit status and summary line are checked. The run without a fault shows
that the summary reports what happened (a restart is not assumed by the checks)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "worker_pool.py"
SUMMARY = re.compile(
    r"^worker_pool: (\d+) batches verified, (\d+) redone, generation (\d+), restart (\d+ ms|none) \(driver (\w+)\)$",
    re.MULTILINE,
)


def run_example(*args: str, timeout: float) -> tuple[int, int, int, str]:
    """Run the example; answer (batches, redone, generation, restart) from its summary."""
    # PYTHONFAULTHANDLER: a run past its timeout is sent SIGABRT, and the failure shows where
    # each of its threads was waiting instead of a bare timeout.
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    with subprocess.Popen(
        [sys.executable, str(EXAMPLE), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGABRT)
            stdout, stderr = child.communicate(timeout=10)
            pytest.fail(f"the example ran past {timeout} s\n{stdout}\n{stderr}")
    done = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
    assert done.returncode == 0, f"exit status {done.returncode}\n{done.stdout}\n{done.stderr}"
    found = SUMMARY.findall(done.stdout)
    assert len(found) == 1 and done.stdout.rstrip().endswith(found[0][4] + ")"), done.stdout
    batches, redone, generation, restart, _ = found[0]
    return int(batches), int(redone), int(generation), restart


@pytest.mark.timeout(40)
def test_the_worker_pool_survives_an_illegal_address_kernel() -> None:
    batches, redone, generation, restart = run_example("--batches", "12", "--fault-after", "4", timeout=30)
    # The fault strikes with WINDOW - 1 = 3 batches in flight: all three are redone.
    assert (batches, redone, generation) == (12, 3, 1)
    assert restart != "none"


@pytest.mark.timeout(40)
def test_without_a_fault_nothing_is_redone() -> None:
    assert run_example("--batches", "4", "--fault-after", "99", timeout=30) == (4, 0, 0, "none")


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("XLOG_ACTORS_SANITIZER") == "1",
                    reason="plants a real illegal address: the sanitizer reports it")
@pytest.mark.timeout(120)
def test_the_worker_pool_survives_an_illegal_address_kernel_on_the_gpu() -> None:
    batches, redone, generation, restart = run_example("--driver", "cuda", timeout=100)
    assert (batches, redone, generation) == (16, 3, 1)
    assert restart != "none"
