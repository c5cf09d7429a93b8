#!/usr/bin/env bash
# Session 7, first probe: the call lane (isolated allocations through shared memory). Its tests
# and the isolated suites (the lane is the default on this 16-core machine), the GPU tests of the
# isolated device, the anatomy (lane vs pipe vs bare ask, interleaved), the bench rows 3 times.
set -u
. scripts/gpu-probe-setup.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/actors/test_call_lane.py tests/actors/test_isolated.py \
    tests/actors/test_isolated_fast.py >"$OUT/pytest-host.txt" 2>&1; echo "host-driver isolated tests rc=$?"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/actors/test_isolated*.py tests/actors/test_shared_ref.py \
    >"$OUT/pytest-gpu.txt" 2>&1; echo "gpu isolated tests rc=$?"
timeout 120 python3 scripts/isolated_anatomy.py cuda 10 2000 >"$OUT/anatomy.txt" 2>&1; echo "anatomy rc=$?"
for i in 1 2 3; do
timeout 100 python3 -m xlog_actors bench --driver cuda --only "isolated Allocate" --only "DeviceActor Allocate" \
    --json "$OUT/bench-$i.json" >"$OUT/bench-$i.txt" 2>&1; echo "bench $i rc=$?"
done
tail -n 2 "$OUT/pytest-host.txt" "$OUT/pytest-gpu.txt"
cat "$OUT/anatomy.txt"
grep -E "^(isolated|DeviceActor)" "$OUT"/bench-*.txt
