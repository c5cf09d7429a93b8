"""``xlog_actors.kernels`` (the public kernel library and ``launch_shape``) and ``check_launch``,
the one judge of a launch both drivers call, at the exact device limits."""

from __future__ import annotations

import inspect
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

import xlog_actors.kernels as kernels
from xlog_actors.driver import checks, limits
from xlog_actors.driver.checks import check_launch
from xlog_actors.errors import DriverError, InvalidRequest
from xlog_actors.kernels import FILL_F32, Kernel, launch_shape


def test_every_kernel_is_exported_and_documented() -> None:
    exported = {name: getattr(kernels, name) for name in kernels.__all__}
    library = {name for name, value in exported.items() if isinstance(value, Kernel)}
    assert library == {"FILL_F32", "SCALE_ADD_F32", "AXPY_F32", "SUM_F32", "CHECKSUM_U32", "SCALE_ADD_CHECKSUM_F32"}
    doc = kernels.__doc__ or ""
    for name in library:
        kernel = exported[name]
        assert f"``{name}``: ``(" in doc, f"{name} has no signature in the module docstring"
        signature = doc.split(f"``{name}``: ``(", 1)[1].split(")``", 1)[0]
        kinds = tuple(part.split(": ")[1] for part in signature.split(", "))
        assert kinds == kernel.params, f"{name}: documented {kinds}, declared {kernel.params}"
    assert "launch_shape" in doc and "grid-stride" in doc


@pytest.mark.parametrize(
    ("n", "block", "expected"),
    [(0, 256, (1, 256)), (1, 256, (1, 256)), (256, 256, (1, 256)), (257, 256, (2, 256)),
     (10**9, 256, (1024, 256)), (1000, 1024, (1, 1024)), (5, 1, (5, 1))],
)
def test_launch_shape(n: int, block: int, expected: tuple[int, int]) -> None:
    assert launch_shape(n, block) == expected
    grid, blk = launch_shape(n, block)
    assert check_launch(FILL_F32, grid, blk, [0, 1.0, n]) == ((grid, 1, 1), (blk, 1, 1))


@pytest.mark.parametrize(
    "kwargs",
    [{"n": -1}, {"n": 1.5}, {"n": True}, {"n": 8, "block": 0}, {"n": 8, "block": 1025},
     {"n": 8, "block": 64.0}, {"n": 8, "max_blocks": 0}, {"n": 8, "max_blocks": None}],
)
def test_launch_shape_refuses_bad_arguments(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest, match="launch_shape"):
        launch_shape(**kwargs)  # type: ignore[arg-type]


MAX_GRID = limits.MAX_GRID_DIMS


@pytest.mark.parametrize(
    ("grid", "block"),
    [(MAX_GRID, 1), (1, (1024, 1, 1)), (1, (1, 1024, 1)), (1, (1, 1, 64)), (1, (16, 16, 4)), (1, (8, 128))],
)
def test_the_exact_device_limits_are_accepted(grid: object, block: object) -> None:
    g, b = check_launch(FILL_F32, grid, block, [0, 0.0, 0])  # type: ignore[arg-type]
    assert all(type(d) is int for d in g + b) and len(g) == len(b) == 3


@pytest.mark.parametrize(
    ("grid", "block"),
    [((MAX_GRID[0] + 1, 1, 1), 1), ((1, MAX_GRID[1] + 1, 1), 1), ((1, 1, MAX_GRID[2] + 1), 1),
     (1, (1025, 1, 1)), (1, (1, 1025, 1)), (1, (1, 1, 65)), (1, (16, 16, 5)), (1, (2, 2, 0))],
)
def test_one_beyond_a_device_limit_is_cuda_invalid_value(grid: object, block: object) -> None:
    with pytest.raises(DriverError) as info:
        check_launch(FILL_F32, grid, block, [0, 0.0, 0])  # type: ignore[arg-type]
    assert info.value.code == "CUDA_ERROR_INVALID_VALUE"
    assert "limit" in str(info.value)


def test_numpy_dims_become_ints() -> None:
    g, b = check_launch(FILL_F32, np.array([3, 2]), np.int16(32), [0, 0.0, 0])
    assert g == (3, 2, 1) and b == (32, 1, 1) and all(type(d) is int for d in g + b)


def test_an_unknown_parameter_kind_is_refused() -> None:
    bad = Kernel(name="k", source="", params=("i16",), host=print)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="unknown parameter kind"):
        check_launch(bad, 1, 1, [1])


@pytest.mark.parametrize("module", ["xlog_actors.kernels", "xlog_actors.driver.checks", "xlog_actors.driver.host",
                                    "xlog_actors.driver.host.driver", "xlog_actors.driver.host.device",
                                    "xlog_actors.driver.host.stream", "xlog_actors.driver.host.memory",
                                    "xlog_actors.driver.host.launch", "xlog_actors.driver.kernel",
                                    "xlog_actors.driver.kernel_library", "xlog_actors.driver.limits"])
def test_every_public_function_and_method_has_a_docstring(module: str) -> None:
    mod = __import__(module, fromlist=["_"])
    assert mod.__doc__
    missing = []
    for name in getattr(mod, "__all__", ()):
        value = getattr(mod, name)
        if not (inspect.isclass(value) or inspect.isfunction(value)):
            continue
        if not inspect.getdoc(value):
            missing.append(name)
        if inspect.isclass(value):
            for attr, member in vars(value).items():
                if attr.startswith("_") or not (inspect.isfunction(member) or isinstance(member, property)):
                    continue
                if not inspect.getdoc(member):
                    missing.append(f"{name}.{attr}")
    assert not missing, f"{module}: no docstring on {missing}"


def test_checks_module_lists_check_launch() -> None:
    assert "check_launch" in checks.__all__ and "Dim3" in checks.__all__


def test_a_kernel_sent_to_another_process_hashes_as_the_equal_kernel_there() -> None:
    """A kernel's hash is computed once (a launch's plan lookup hashes it), and a string's hash
    differs between processes: an unpickled kernel must hash as the equal kernel made there."""
    code = ("import pickle, sys; from xlog_actors.kernels import FILL_F32; "
            "k = pickle.loads(sys.stdin.buffer.read()); print(k == FILL_F32, {FILL_F32: 'found'}.get(k))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # a seed unlike this process's random one
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(FILL_F32), capture_output=True,
                         timeout=60, env=env, check=True)
    assert out.stdout.split() == [b"True", b"found"]
