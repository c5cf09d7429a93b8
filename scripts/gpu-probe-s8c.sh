#!/usr/bin/env bash
# Session 8, third probe: the final code's client slot read and plain-descriptor access(); the
# actor and memory GPU tests, then the client, access and allocation rows twice.
set -u
. scripts/gpu-probe-setup.sh
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/actors tests/memory >"$OUT/pytest.txt" 2>&1
echo "gpu actor+memory tests rc=$?"
bench_rows 2 "AsyncCudaResource alloc+free" "DeviceClient" "AllocateMany" "GpuRef.access"
tail -n 2 "$OUT/pytest.txt"
grep -E "^(AsyncCuda|DeviceClient|DeviceActor|GpuRef)" "$OUT"/bench-*.txt
