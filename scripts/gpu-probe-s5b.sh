#!/usr/bin/env bash
# Session 5, second probe call: the fix for allocations served in the caller's thread (the GPU
# supervision and library-actor tests, plain and under memcheck) and the actor rows, twice.
set -u
. scripts/gpu-probe-setup.sh
T="tests/actors/test_gpu_supervision.py tests/actors/test_library_actors.py tests/actors/test_caller_inbox.py tests/actors/test_isolated.py"
SAN=$(command -v compute-sanitizer 2>/dev/null || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
XLOG_ACTORS_SANITIZER=1 timeout 200 "$SAN" --tool memcheck --target-processes all --report-api-errors no --error-exitcode 9 \
    python3 -m pytest -q -m gpu -p no:cacheprovider $T >"$OUT/memcheck.txt" 2>&1 &
SP=$!
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider $T >"$OUT/pytest.txt" 2>&1; echo "pytest rc=$?"
wait $SP; echo "memcheck rc=$?"
for i in 1 2; do
timeout 120 python3 -m xlog_actors bench --driver cuda --only "DeviceActor" --only "DeviceClient" --only "Allocate 16" \
    --only "isolated Allocate" --only "AsyncCudaResource alloc+free" --json "$OUT/bench-$i.json" >"$OUT/bench-$i.txt" 2>&1; echo "bench $i rc=$?"
done
tail -n 3 "$OUT/pytest.txt"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.txt" | tail -n 3
grep -E "^(Device|Allocate|isolated|Async)" "$OUT/bench-1.txt" "$OUT/bench-2.txt"
