#!/usr/bin/env bash
# Session 8, second probe: the live-blocks scaling row (its raw twin read 1.71x in the 01:53 full
# check, 1.06-1.10x before) and the allocation rows, twice each.
set -u
. scripts/gpu-probe-setup.sh
for i in 1 2; do
timeout 100 python3 -m xlog_actors bench --driver cuda --only "scaling (live blocks)" --only "AsyncCudaResource alloc+free" \
    --only "DeviceClient allocate" --only "AllocateMany" --json "$OUT/bench-$i.json" >"$OUT/bench-$i.txt" 2>&1
echo "bench $i rc=$?"
done
grep -E "^(AsyncCuda|raw pair|DeviceClient|DeviceActor)" "$OUT"/bench-*.txt
