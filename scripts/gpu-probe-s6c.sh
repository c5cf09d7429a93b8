#!/usr/bin/env bash
# Session 6, third probe: the isolated Allocate after the reply reader's idle spin, plain-field
# pickling of Allocate and RemoteBlock and the standard pickler on the pipe; its GPU tests.
set -u
. scripts/gpu-probe-setup.sh
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/actors/test_isolated*.py tests/actors/test_shared_ref.py >"$OUT/pytest.txt" 2>&1; echo "pytest rc=$?"
for i in 1 2 3; do
timeout 100 python3 -m xlog_actors bench --driver cuda --only "isolated Allocate" --only "DeviceActor Allocate" \
    --json "$OUT/bench-$i.json" >"$OUT/bench-$i.txt" 2>&1; echo "bench $i rc=$?"
done
tail -n 3 "$OUT/pytest.txt"
grep -E "^(isolated|DeviceActor)" "$OUT"/bench-*.txt
