#!/usr/bin/env bash
# Session 9, fourth probe: the training-loop row with its halves interleaved (ABBA), the resource
# pair and the two concurrency rows, twice, on this session's final code.
set -u
. scripts/gpu-probe-setup.sh
BENCH_TIMEOUT=200 bench_rows 2 "torch training loop through device" "AsyncCudaResource alloc+free" "threads /" "workers /"
grep -E "^(torch training|AsyncCuda|DeviceClient 8|Allocate 16)" "$OUT"/bench-*.txt
