#!/usr/bin/env bash
# Free-threading probe: does cuMemAllocFromPoolAsync + cuMemFreeAsync through cuda.bindings scale
# with threads when Python has no GIL (scripts/ft_driver_probe.py)? Run from the repository root on
# the GPU machine. Uses the free-threaded CPython carried in .ft/ (.ft/python, its cuda-bindings in
# .ft/site): once as it is (GIL off), once with PYTHON_GIL=1 (GIL forced on, same interpreter); then
# a control without the allocator each way (--variant control); then under the system python3 (GIL
# build) where cuda.bindings imports from /tmp/site.
set -u
OUT=${OUT:-/tmp/xlog-probe}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
FT=.ft/python/bin/python3
# Arguments go to the probe. Without any, 50000 pairs a thread: a run with the GIL takes about
# 150 single-thread samples' time (5 rounds x 2 variants x 1+2+4+8 threads), which must fit in 120 s.
ARGS=("$@")
[ $# -eq 0 ] && ARGS=(--pairs 50000)

PYTHONPATH=.ft/site timeout 120 "$FT" scripts/ft_driver_probe.py "${ARGS[@]}" >"$OUT/ft-nogil.txt" 2>&1
echo "ft nogil rc=$?"
PYTHON_GIL=1 PYTHONPATH=.ft/site timeout 120 "$FT" scripts/ft_driver_probe.py "${ARGS[@]}" >"$OUT/ft-gil.txt" 2>&1
echo "ft gil rc=$?"
# The control (no allocator: how far interpreter and bindings scale by themselves), both ways.
PYTHONPATH=.ft/site timeout 120 "$FT" scripts/ft_driver_probe.py "${ARGS[@]}" --variant control --repeats 3 >"$OUT/ft-nogil-control.txt" 2>&1
echo "ft nogil control rc=$?"
PYTHON_GIL=1 PYTHONPATH=.ft/site timeout 120 "$FT" scripts/ft_driver_probe.py "${ARGS[@]}" --variant control --repeats 3 >"$OUT/ft-gil-control.txt" 2>&1
echo "ft gil control rc=$?"
if PYTHONPATH=/tmp/site python3 -c "import cuda.bindings" 2>/dev/null; then
    PYTHONPATH=/tmp/site timeout 120 python3 scripts/ft_driver_probe.py "${ARGS[@]}" >"$OUT/ft-sys312.txt" 2>&1
    echo "sys python3 rc=$?"
else
    echo "system python3: cuda.bindings does not import from /tmp/site; skipped" | tee "$OUT/ft-sys312.txt"
fi
for f in ft-nogil ft-gil ft-nogil-control ft-gil-control ft-sys312; do
    echo "===== $f"
    cat "$OUT/$f.txt"
done
