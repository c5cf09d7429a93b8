#!/usr/bin/env bash
# One device call of probes (session 5): the 16-worker variants, the torch/CuPy/RMM routes, the
# cross-process handle timings and a few bench rows. Writes its logs under $OUT.
set -u
. scripts/gpu-probe-setup.sh
nproc; python3 --version
timeout 120 python3 scripts/workers_anatomy.py cuda --rounds 40 >"$OUT/workers.txt" 2>&1; echo "workers rc=$?"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/interop/test_routes_on_gpu.py tests/actors/test_shared_ref.py >"$OUT/interop.txt" 2>&1; echo "pytest rc=$?"
timeout 60 python3 scripts/shared_ref_timing.py cuda >"$OUT/shared_ref.txt" 2>&1; echo "shared_ref rc=$?"
timeout 150 python3 -m xlog_actors bench --driver cuda --only "GpuRef.access" --only "torch training loop" \
    --only "isolated Allocate" --only "DeviceClient allocate" --only "AllocateMany" --only "AsyncCudaResource alloc+free" \
    --json "$OUT/bench-part.json" >"$OUT/bench.txt" 2>&1; echo "bench rc=$?"
tail -n 25 "$OUT/workers.txt"; tail -n 5 "$OUT/interop.txt"; tail -n 15 "$OUT/shared_ref.txt"; tail -n 30 "$OUT/bench.txt"
