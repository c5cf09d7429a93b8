"""Builds the compiled core (``xlog_actors._core``); everything else is in pyproject.toml.

The extensions need a C compiler (and a C++ one for ``alloc_bridge``) and the Python headers,
nothing of CUDA: the core declares the few driver entry points it calls and gets their addresses
at run time. A build that cannot compile stops with a message naming what is missing; there is no pure-Python fallback.
The modules compile in parallel, one job per core (``XLOG_ACTORS_BUILD_JOBS=N`` or ``build_ext -j N`` to change that).
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:
    from Cython.Build import cythonize
except ImportError:  # pragma: no cover - the build requirements name Cython
    sys.exit("xlog_actors: building the compiled core needs Cython>=3.0 (pip install Cython)")

_MODULES = (
    "ptr_table",
    "blocks",
    "ops",
    "history_ring",
    "resource_core",
    "async_core",
    "cache_core",
    "direct_core",
    "handles",
    "context_core",
    "client_core",
    "doorbell",
    "fdwait",
    "call_lane",
    "graph_replay",
    "library_core",
    "posted_serve",
    "null_allocator",
    # C++ (its `# distutils: language = c++` line): it throws a C++ exception to PyTorch.
    "alloc_bridge",
)

#: Per-module C macros. alloc_bridge's ``cdef public`` functions are loaded by name (dlsym), so
#: in C++ they must have C linkage: Cython's default for them there is ``extern "C++"``.
_MACROS = {"alloc_bridge": [("CYTHON_EXTERN_C", 'extern "C"')]}


def _jobs() -> int:
    """Compile jobs when none is given: ``$XLOG_ACTORS_BUILD_JOBS``, else one per usable core."""
    given = os.environ.get("XLOG_ACTORS_BUILD_JOBS", "").strip()
    if given:
        if not given.isdigit():
            sys.exit(f"xlog_actors: XLOG_ACTORS_BUILD_JOBS must be a whole number of jobs, not {given!r}")
        return max(1, int(given))
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may run on (containers, taskset)
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class BuildCore(build_ext):
    """``build_ext`` that compiles the modules in parallel and turns a missing compiler or missing
    Python headers into one clear line.

    Parallel: each extension is its own compiler run, so with no ``-j``/``--parallel`` given (pip,
    ``python -m build``, an editable install never pass one) the modules compile on a pool of
    :func:`_jobs` threads; ``-j 1`` compiles them one after the other.
    """

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:  # neither `build_ext -j N` nor `build -j N`
            self.parallel = _jobs()

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - re-raised as one clear message
            raise SystemExit(
                "xlog_actors: the compiled core (xlog_actors._core) could not be built: "
                f"{type(exc).__name__}: {exc}\n"
                "It needs a C compiler (cc/gcc, found through $CC), a C++ compiler for the allocator "
                "bridge (c++/g++, through $CXX) and the Python development headers (Python.h: e.g. "
                "the python3-dev package). No CUDA toolkit is needed."
            ) from None


setup(
    ext_modules=cythonize(
        [
            Extension(
                f"xlog_actors._core.{name}", [f"xlog_actors/_core/{name}.pyx"], define_macros=_MACROS.get(name, [])
            )
            for name in _MODULES
        ],
        compiler_directives={"language_level": "3", "embedsignature": True},
        quiet=True,
    ),
    cmdclass={"build_ext": BuildCore},
)
