#!/usr/bin/env bash
# Session 8, third probe: the final code's client slot read and plain-descriptor access(); the
# actor and memory GPU tests, then the client, access and allocation rows twice.
set -u
. scripts/gpu-probe-setup.sh
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/actors tests/memory >"$OUT/pytest.txt" 2>&1
echo "gpu actor+memory tests rc=$?"
for i in 1 2; do
timeout 100 python3 -m xlog_actors bench --driver cuda --only "AsyncCudaResource alloc+free" --only "DeviceClient" \
    --only "AllocateMany" --only "GpuRef.access" --json "$OUT/bench-$i.json" >"$OUT/bench-$i.txt" 2>&1
echo "bench $i rc=$?"
done
tail -n 2 "$OUT/pytest.txt"
grep -E "^(AsyncCuda|DeviceClient|DeviceActor|GpuRef)" "$OUT"/bench-*.txt
