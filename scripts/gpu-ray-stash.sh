#!/usr/bin/env bash
# The Ray wheel (79 MB) is larger than one device call carries (64 MiB), so it travels in two
# halves: this first call stores half A (.raywhl-a/) on the machine, and scripts/gpu-ray.sh, the
# next call on the same warm machine, joins it with half B (.raywhl-b/, with Ray's dependencies)
# and installs it. The halves are `split -b 41000000` of ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl.
#
# Usage (repository root, on the GPU machine, .raywhl-a/ carried):  scripts/gpu-ray-stash.sh
# When to use: the first of the two device calls that run the Ray tests on a GPU (tests/ray_actors,
# marker gpu), after a change to xlog_actors.ray or to isolated CUDA devices; scripts/gpu-ray.sh next.
# Options: -h, --help prints this text.
case "${1:-}" in -h | --help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
set -eu
mkdir -p /tmp/raystash
cp .raywhl-a/ray.part.aa /tmp/raystash/
ls -la /tmp/raystash
