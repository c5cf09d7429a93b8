#!/usr/bin/env bash
# Session 9, fifth probe: the stream pool keyed by StreamId.DEFAULT itself: the memory and actor
# GPU tests, then the allocation rows twice.
set -u
. scripts/gpu-probe-setup.sh
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/memory tests/actors >"$OUT/pytest.txt" 2>&1
echo "gpu actor+memory tests rc=$?"
bench_rows 2 "AsyncCudaResource alloc+free" "DeviceClient allocate" "AllocateMany" "prepare+finish"
tail -n 1 "$OUT/pytest.txt"
grep -E "^(AsyncCuda|DeviceClient|DeviceActor|cross-stream)" "$OUT"/bench-*.txt
