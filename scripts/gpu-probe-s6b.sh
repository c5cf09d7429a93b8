#!/usr/bin/env bash
# Session 6, second probe call: library actors' blocking asks served in the asker's thread
# (served_ref): their GPU tests, the copy rows and the demo row beside their raw twins, twice.
set -u
. scripts/gpu-probe-setup.sh
T="tests/actors/test_served_ref.py tests/actors/test_library_actors.py tests/actors/test_launches.py tests/actors/test_pinned.py tests/cli/test_demo.py tests/actors/test_gpu_supervision.py"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider $T >"$OUT/pytest.txt" 2>&1; echo "pytest rc=$?"
for i in 1 2; do
timeout 150 python3 -m xlog_actors bench --driver cuda --only "CopyActor" --only "driver copy" --only "demo pipeline" \
    --json "$OUT/bench-$i.json" >"$OUT/bench-$i.txt" 2>&1; echo "bench $i rc=$?"
done
timeout 100 python3 -m xlog_actors demo --driver cuda >"$OUT/demo.txt" 2>&1; echo "demo rc=$?"
tail -n 3 "$OUT/pytest.txt"; tail -n 4 "$OUT/demo.txt"
grep -E "^(CopyActor|driver|demo)" "$OUT/bench-1.txt" "$OUT/bench-2.txt"
