#!/usr/bin/env bash
# Session 9, first probe: the concurrency rows at three sample lengths (scripts/scaling_probe.py),
# on the CUDA driver and on the host driver, on the 16-core GPU machine.
set -u
. scripts/gpu-probe-setup.sh
timeout 150 python3 scripts/scaling_probe.py cuda --rounds 7 >"$OUT/scaling-cuda.txt" 2>&1
echo "cuda rc=$?"
timeout 150 python3 scripts/scaling_probe.py host --rounds 3 >"$OUT/scaling-host.txt" 2>&1
echo "host rc=$?"
grep -v "^round" "$OUT"/scaling-*.txt
