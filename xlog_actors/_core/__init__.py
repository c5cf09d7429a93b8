"""The compiled core (Cython): the block value types, the bodies of ``AsyncCudaResource`` and
``DirectCudaResource``, their event pool, and the driver calls they make.

It sits between the driver layer and the memory layer: it imports ``driver`` (checks, limits),
and ``memory`` is its Python face. On CUDA its calls reach ``libcuda`` through entry points the
driver resolved at run time (no ``cuda.h`` at build time); on the host driver the same compiled
code calls the host driver's Python methods, so the suites that run without a GPU exercise the
code that runs on one.

``pip install .`` (or ``pip install -e .``) builds it; it needs a C compiler and the Python
headers. After editing a ``.pyx`` file, rebuild in place with
``python setup.py build_ext --inplace``.

Thread rule: see each module; everything here may be used from any thread.
"""

from __future__ import annotations

try:
    from . import (  # noqa: F401
        alloc_bridge,
        async_core,
        blocks,
        client_core,
        context_core,
        direct_core,
        doorbell,
        handles,
        history_ring,
        ops,
        ptr_table,
        resource_core,
    )
except ImportError as _exc:  # pragma: no cover - exercised by tests/test_packaging.py in a subprocess
    raise ImportError(
        "xlog_actors' compiled core is not built (" + str(_exc) + "). Build it with "
        "`pip install -e .` or, in a checkout, `python setup.py build_ext --inplace`; "
        "that needs a C compiler and the Python headers (no CUDA toolkit)."
    ) from _exc
