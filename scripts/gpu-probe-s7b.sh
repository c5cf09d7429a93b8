#!/usr/bin/env bash
# Session 7, second probe: the device-actor rows four times after the caller inbox counts an actor
# that serves a wake-up as idle (AllocateMany(64) read 1.36x to 1.71x at 23:19), and the caller
# inbox's GPU tests.
set -u
. scripts/gpu-probe-setup.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/actors/test_caller_inbox.py tests/actors/test_device_actor.py \
    >"$OUT/pytest.txt" 2>&1; echo "caller inbox + device actor tests rc=$?"
for i in 1 2 3 4; do
timeout 100 python3 -m xlog_actors bench --driver cuda --only "DeviceActor Allocate" --only "AllocateMany" \
    --only "isolated Allocate" --json "$OUT/bench-$i.json" >"$OUT/bench-$i.txt" 2>&1; echo "bench $i rc=$?"
done
tail -n 2 "$OUT/pytest.txt"
grep -E "^(isolated|DeviceActor)" "$OUT"/bench-*.txt
