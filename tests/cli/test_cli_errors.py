"""Every command-line mistake is answered at once: one line on stderr naming the flag and what it
accepts, exit status 2 (1 where ``--driver cuda`` finds no usable GPU), no traceback, no hang.
Every bad flag goes through the command line's entry point in this process, and a few of each
command through their own process, as a user would run them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import xlog_actors as xa
from xlog_actors.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _gpu_reachable() -> bool:
    try:
        xa.open_driver("cuda").close()
    except xa.DeviceUnavailable:
        return False
    return True


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "xlog_actors", *args],
        capture_output=True, text=True, timeout=timeout, check=False, env=full_env, cwd=ROOT,
    )


BAD_INVOCATIONS = [
    (["demo", "--driver", "host", "--batches", "0"], "--batches"),
    (["demo", "--driver", "host", "--batches", "-1"], "--batches"),
    (["demo", "--driver", "host", "--batches", "many"], "--batches"),
    (["demo", "--driver", "host", "--depth", "0"], "--depth"),
    (["demo", "--driver", "host", "--depth", "-1"], "--depth"),
    (["demo", "--driver", "host", "--batch-mib", "0"], "--batch-mib"),
    (["demo", "--driver", "host", "--batch-mib", "-1"], "--batch-mib"),
    (["demo", "--driver", "host", "--batch-mib", "nan"], "--batch-mib"),
    (["demo", "--driver", "host", "--rebuild-at", "999"], "--rebuild-at"),
    (["demo", "--driver", "host", "--batches", "4", "--rebuild-at", "4"], "--rebuild-at"),
    (["demo", "--driver", "host", "--rebuild-at", "-1"], "--rebuild-at"),
    (["demo", "--driver", "host", "--slow-producer-us", "-5"], "--slow-producer-us"),
    (["demo", "--driver", "gpu"], "--driver"),
    (["demo", "--driver", "host", "--devices", "0"], "--devices"),
    (["demo", "--driver", "host", "--devices", "-2"], "--devices"),
    (["demo", "--driver", "host", "--devices", "some"], "--devices"),
    (["demo", "--driver", "host", "--devices", "17"], "--devices"),
    (["demo", "--driver", "host", "--placement", "isolated"], "--placement"),
    (["demo", "--driver", "host", "--devices", "2", "--fault-device", "1"], "--fault-at"),
    (["demo", "--driver", "host", "--devices", "2", "--fault-at", "3"], "--fault-device"),
    (["demo", "--driver", "host", "--fault-device", "0", "--fault-at", "3"], "--fault-device"),
    (["demo", "--driver", "host", "--devices", "2", "--fault-device", "2", "--fault-at", "3"], "--fault-device"),
    (["demo", "--driver", "host", "--devices", "2", "--fault-device", "-1", "--fault-at", "3"], "--fault-device"),
    (["demo", "--driver", "host", "--devices", "2", "--batches", "4", "--fault-device", "1", "--fault-at", "4"],
     "--fault-at"),
    (["demo", "--driver", "host", "--devices", "2", "--fault-device", "1", "--fault-at", "x"], "--fault-at"),
    (["bench", "--driver", "host", "--json", "/nonexistent-dir/x.json"], "--json"),
    (["bench", "--driver", "host", "--json", "/"], "--json"),
    (["bench", "--driver", "host", "--only", "no such row"], "--only"),
    (["frobnicate"], "frobnicate"),
]


@pytest.mark.parametrize(("args", "flag"), BAD_INVOCATIONS, ids=[" ".join(a) for a, _ in BAD_INVOCATIONS])
def test_a_bad_flag_is_one_line_and_exit_status_2(
    args: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # In this process, through the command line's own entry point (a process each took 10 s more
    # in all); the test below runs the same checks through a real process once per command.
    try:
        status = main(args)
    except SystemExit as exc:  # argparse's own refusals
        status = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    assert status == 2, (status, out.err)
    assert "Traceback" not in out.err
    lines = out.err.splitlines()
    assert len(lines) == 1, out.err
    assert flag in lines[0], lines[0]
    assert out.out == ""


@pytest.mark.parametrize(
    ("args", "flag"),
    [(["demo", "--driver", "host", "--batches", "0"], "--batches"),
     (["demo", "--driver", "host", "--devices", "2", "--fault-device", "2", "--fault-at", "3"], "--fault-device"),
     (["bench", "--driver", "host", "--only", "no such row"], "--only"),
     (["frobnicate"], "frobnicate")],
)
def test_a_bad_flag_in_a_real_process_is_one_line_and_exit_status_2(args: list[str], flag: str) -> None:
    proc = _run(*args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert flag in lines[0], lines[0]
    assert proc.stdout == ""


@pytest.mark.parametrize("command", ["info", "demo", "bench"])
def test_a_bogus_driver_variable_is_one_line_and_exit_status_2(command: str) -> None:
    proc = _run(command, env={"XLOG_ACTORS_DRIVER": "bogus"})
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and "Traceback" not in proc.stderr
    assert "XLOG_ACTORS_DRIVER='bogus'" in proc.stderr and "auto, cuda, host" in proc.stderr


@pytest.mark.skipif(_gpu_reachable(), reason="a GPU is reachable here: --driver cuda works")
@pytest.mark.parametrize("command", ["info", "demo", "bench"])
def test_driver_cuda_without_a_gpu_names_what_is_missing_and_exits_1(command: str) -> None:
    proc = _run(command, "--driver", "cuda")
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "--driver cuda: no usable GPU:" in lines[0]
    assert "libcuda" in lines[0] or "device" in lines[0] or "driver" in lines[0]


def test_version_prints_the_package_version() -> None:
    proc = _run("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"xlog-actors {xa.__version__}"


def test_a_closed_stdout_ends_quietly() -> None:
    """``xlog-actors info | head -c1``: the reader goes away after one byte."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "xlog_actors", "info", "--driver", "host"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(1)
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    status = proc.wait(timeout=30)
    assert status in (0, 141), (status, stderr)
    assert stderr == "", stderr


@pytest.mark.parametrize(
    ("args", "env", "reason"),
    [
        (["--driver", "host"], {}, "driver: host (--driver host)"),
        ([], {"XLOG_ACTORS_DRIVER": "host"}, "driver: host (XLOG_ACTORS_DRIVER=host)"),
    ],
)
def test_demo_and_bench_say_first_which_driver_and_why(args: list[str], env: dict[str, str], reason: str) -> None:
    demo = _run("demo", "--batches", "2", "--batch-mib", "0.0625", *args, env=env)
    assert demo.returncode == 0, demo.stderr
    assert reason in demo.stderr.splitlines()[0]
    bench = _run("bench", "--quick", "--only", "GpuRef.access", *args, env=env, timeout=60)
    assert bench.returncode == 0, bench.stderr
    assert reason in bench.stderr.splitlines()[0]


@pytest.mark.skipif(_gpu_reachable(), reason="a GPU is reachable here: auto picks it")
def test_auto_says_it_fell_back_to_the_host_and_why() -> None:
    env = {k: v for k, v in os.environ.items() if k != "XLOG_ACTORS_DRIVER"}
    proc = subprocess.run(
        [sys.executable, "-m", "xlog_actors", "info"], capture_output=True, text=True, timeout=30, check=False,
        env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith("driver         host (auto: no CUDA GPU reachable: "), first


@pytest.mark.parametrize("depth", ["1", "8"])
def test_demo_finishes_for_small_and_large_depths(depth: str) -> None:
    proc = _run("demo", "--driver", "host", "--batches", "3", "--batch-mib", "0.0625", "--depth", depth,
                "--rebuild-at", "2", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "verification  ok: 3/3" in proc.stdout
