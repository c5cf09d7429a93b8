#!/usr/bin/env bash
# Session 8, first probe: the core's version cell, cached stream verdict and CAS lock on libcuda;
# the memory, driver and actor GPU tests, then the allocator and client rows three times and the
# DeviceClient pair layer by layer.
set -u
. scripts/gpu-probe-setup.sh
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/memory tests/driver tests/actors >"$OUT/pytest.txt" 2>&1
echo "gpu memory+driver+actor tests rc=$?"
for i in 1 2 3; do
timeout 100 python3 -m xlog_actors bench --driver cuda --only "AsyncCudaResource alloc+free" --only "DirectCudaResource" \
    --only "prepare+finish" --only "DeviceClient" --only "AllocateMany" --only "DeviceActor Allocate" \
    --only "GpuRef.access" --json "$OUT/bench-$i.json" >"$OUT/bench-$i.txt" 2>&1
echo "bench $i rc=$?"
done
timeout 60 python3 scripts/client_layers.py cuda 10 20000 >"$OUT/layers.txt" 2>&1
tail -n 2 "$OUT/pytest.txt"
grep -E "^(AsyncCuda|DirectCuda|cross|DeviceClient|DeviceActor|GpuRef)" "$OUT"/bench-*.txt
cat "$OUT/layers.txt"
