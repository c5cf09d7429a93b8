#!/usr/bin/env bash
# Session 9, second probe: the concurrency rows at three sample lengths with the sleeps of every
# thread counted, at the default switch interval and at 50 ms (a diagnostic: how much of the loss
# is the interpreter's forced switches).
set -u
. scripts/gpu-probe-setup.sh
timeout 120 python3 scripts/scaling_probe.py cuda --rounds 5 >"$OUT/scaling-cuda.txt" 2>&1
echo "cuda rc=$?"
timeout 120 python3 scripts/scaling_probe.py cuda --rounds 5 --switch-ms 50 >"$OUT/scaling-cuda-50ms.txt" 2>&1
echo "cuda 50 ms rc=$?"
grep -v "^round" "$OUT"/scaling-*.txt
