#!/usr/bin/env bash
# Session 6, last probe: the copy rows three times (their ratio moves by about 1.5% between runs)
# and the isolated Allocate variants interleaved, on the final code.
set -u
. scripts/gpu-probe-setup.sh
for i in 1 2 3; do
timeout 120 python3 -m xlog_actors bench --driver cuda --only "CopyActor H2D" --only "CopyActor D2D" \
    --only "cross-process read" --json "$OUT/copies-$i.json" >"$OUT/copies-$i.txt" 2>&1; echo "copies $i rc=$?"
done
timeout 200 python3 scripts/isolated_anatomy.py cuda 10 2000 >"$OUT/isolated-anatomy.txt" 2>&1; echo "anatomy rc=$?"
grep -E "^(CopyActor|cross)" "$OUT"/copies-*.txt; cat "$OUT/isolated-anatomy.txt"
