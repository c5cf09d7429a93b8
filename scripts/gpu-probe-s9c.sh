#!/usr/bin/env bash
# Session 9, third probe: on the free-threaded CPython carried in .ft/ (GIL off), allocate+free
# pairs from 1 to 8 threads each on a stream of its own, on the device's one pool against a pool
# per thread (scripts/ft_driver_probe.py --variant pools).
set -u
OUT=${OUT:-/tmp/xlog-probe}; mkdir -p "$OUT"
PYTHONPATH=.ft/site timeout 150 .ft/python/bin/python3 scripts/ft_driver_probe.py --variant pools --pairs 50000 >"$OUT/ft-pools-nogil.txt" 2>&1
echo "ft pools rc=$?"
grep -v "^round" "$OUT/ft-pools-nogil.txt"
