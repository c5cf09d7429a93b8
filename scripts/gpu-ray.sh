#!/usr/bin/env bash
# Second Ray call (after scripts/gpu-ray-stash.sh on the same machine): join and install the Ray
# wheel and its dependencies, then run the Ray tests: the GPU ones (tests/ray_actors/, marker gpu)
# and the host-driver suite, on a simulated three-node cluster on this machine.
#
# Usage (repository root, same warm GPU machine, .whl/ and .raywhl-b/ carried):  scripts/gpu-ray.sh
# Environment: OUT (logs, default /tmp/xlog-ray), RAY_GPU_TIMEOUT (seconds for the GPU tests,
#   default 250), RAY_HOST_SUITE=0 skips the host-driver suite.
# When to use: the second call, right after scripts/gpu-ray-stash.sh (see there).
# Options: -h, --help prints this text.
case "${1:-}" in -h | --help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;; esac
set -u
OUT=${OUT:-/tmp/xlog-ray}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -f /tmp/raystash/ray.part.aa ] || { echo "half A missing: run scripts/gpu-ray-stash.sh first on this machine"; exit 3; }
cat /tmp/raystash/ray.part.aa .raywhl-b/ray.part.ab > /tmp/raystash/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
sha256sum /tmp/raystash/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >"$OUT/install.txt" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-ray \
    /tmp/raystash/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl .raywhl-b/*.whl >>"$OUT/install.txt" 2>&1 || { tail "$OUT/install.txt"; exit 1; }
export PYTHONPATH=/tmp/site:/tmp/site-ray:$PWD PATH=/tmp/site-ray/bin:/tmp/site/bin:$PATH
python3 -c "import ray; print('ray', ray.__version__)"
python3 setup.py -q build_ext --inplace >"$OUT/build.txt" 2>&1 || { tail -20 "$OUT/build.txt"; exit 1; }
timeout ${RAY_GPU_TIMEOUT:-250} python3 -m pytest -q -p no:cacheprovider -m gpu tests/ray_actors >"$OUT/ray-gpu.txt" 2>&1; echo "ray gpu rc=$?"
tail -n 5 "$OUT/ray-gpu.txt"
if [ "${RAY_HOST_SUITE:-1}" = 1 ]; then
timeout 250 python3 -m pytest -q -p no:cacheprovider tests/ray_actors >"$OUT/ray-host.txt" 2>&1; echo "ray host suite rc=$?"
tail -n 5 "$OUT/ray-host.txt"
fi
