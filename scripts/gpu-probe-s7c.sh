#!/usr/bin/env bash
# Session 7, third probe: the allocation rows (resource, client, device actor) four times after the
# context reads the runtime's calls once and a block's ptr in C; the actor and memory GPU tests.
set -u
. scripts/gpu-probe-setup.sh
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/actors tests/memory >"$OUT/pytest.txt" 2>&1
echo "gpu actor+memory tests rc=$?"
for i in 1 2 3 4; do
timeout 100 python3 -m xlog_actors bench --driver cuda --only "AsyncCudaResource alloc+free" --only "DeviceClient allocate" \
    --only "AllocateMany" --only "DeviceActor Allocate" --json "$OUT/bench-$i.json" >"$OUT/bench-$i.txt" 2>&1
echo "bench $i rc=$?"
done
tail -n 2 "$OUT/pytest.txt"
grep -E "^(AsyncCuda|DeviceClient|DeviceActor)" "$OUT"/bench-*.txt
