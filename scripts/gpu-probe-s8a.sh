#!/usr/bin/env bash
# Session 8, first probe: the core's version cell, cached stream verdict and CAS lock on libcuda;
# the memory, driver and actor GPU tests, then the allocator and client rows three times and the
# DeviceClient pair layer by layer.
set -u
. scripts/gpu-probe-setup.sh
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/memory tests/driver tests/actors >"$OUT/pytest.txt" 2>&1
echo "gpu memory+driver+actor tests rc=$?"
bench_rows 3 "AsyncCudaResource alloc+free" "DirectCudaResource" "prepare+finish" "DeviceClient" "AllocateMany" "DeviceActor Allocate" "GpuRef.access"
timeout 60 python3 scripts/client_layers.py cuda 10 20000 >"$OUT/layers.txt" 2>&1
tail -n 2 "$OUT/pytest.txt"
grep -E "^(AsyncCuda|DirectCuda|cross|DeviceClient|DeviceActor|GpuRef)" "$OUT"/bench-*.txt
cat "$OUT/layers.txt"
