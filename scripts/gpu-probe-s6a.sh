#!/usr/bin/env bash
# Session 6, first probe call: where an isolated Allocate's 151 us go on the H200 (py-spy of the
# parent and the device process, idle included; per-op wall time of the loop), and the copy rows'
# baseline beside their raw twins before the served-ref work.
set -u
. scripts/gpu-probe-setup.sh
cat >/tmp/iso_loop.py <<'PY'
import sys, time, os
from xlog_actors.actors import Allocate, DeviceActor

def main(kind: str, n: int) -> None:
    dev = DeviceActor.start(0, kind, isolate=True)
    msg = Allocate(4096)
    held = [None]
    for _ in range(2000):
        held[0] = None; held[0] = dev.ask(msg)
    print("ready", os.getpid(), flush=True)
    for rnd in range(3):
        t = time.perf_counter()
        for _ in range(n):
            held[0] = None; held[0] = dev.ask(msg)
        print(f"round {rnd}: {(time.perf_counter()-t)/n*1e6:.1f} us/op", flush=True)
    held[0] = None
    dev.stop()

if __name__ == "__main__":
    main(sys.argv[2] if len(sys.argv) > 2 else "cuda", int(sys.argv[1]))
PY
timeout 60 python3 /tmp/iso_loop.py 5000 >"$OUT/iso-plain.txt" 2>&1; echo "plain rc=$?"
timeout 120 py-spy record --subprocesses --idle -r 2000 --format raw -o "$OUT/iso-idle.raw" -- python3 /tmp/iso_loop.py 20000 >"$OUT/iso-spy.txt" 2>&1; echo "spy rc=$?"
timeout 120 py-spy record --subprocesses --native -r 2000 --format raw -o "$OUT/iso-native.raw" -- python3 /tmp/iso_loop.py 20000 >"$OUT/iso-spy2.txt" 2>&1; echo "spy2 rc=$?"
for i in 1 2; do
timeout 150 python3 -m xlog_actors bench --driver cuda --only "CopyActor" --only "driver copy" --only "isolated Allocate" \
    --json "$OUT/bench-$i.json" >"$OUT/bench-$i.txt" 2>&1; echo "bench $i rc=$?"
done
cat "$OUT/iso-plain.txt"; tail -3 "$OUT/iso-spy.txt"
grep -E "^(CopyActor|driver|isolated)" "$OUT/bench-1.txt" "$OUT/bench-2.txt"
