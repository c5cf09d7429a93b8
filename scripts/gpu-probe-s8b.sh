#!/usr/bin/env bash
# Session 8, second probe: the live-blocks scaling row (its raw twin read 1.71x in the 01:53 full
# check, 1.06-1.10x before) and the allocation rows, twice each.
set -u
. scripts/gpu-probe-setup.sh
bench_rows 2 "scaling (live blocks)" "AsyncCudaResource alloc+free" "DeviceClient allocate" "AllocateMany"
grep -E "^(AsyncCuda|raw pair|DeviceClient|DeviceActor)" "$OUT"/bench-*.txt
