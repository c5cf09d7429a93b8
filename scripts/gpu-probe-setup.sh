# Sourced by the scripts/gpu-probe-*.sh scripts, in the repository root on the GPU machine: an $OUT
# folder for their records, the carried wheels (.whl) installed into /tmp/site and put on the
# paths, the compiled core built in place. Exits the probe when the build fails.
OUT=${OUT:-/tmp/xlog-probe}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >"$OUT/install.txt" 2>&1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
python3 setup.py -q build_ext --inplace >"$OUT/build.txt" 2>&1 || { tail -20 "$OUT/build.txt"; exit 1; }

# bench_rows N ROW...: the bench rows whose names contain one of ROW..., N times, each run's text
# and JSON as $OUT/bench-<i>.{txt,json}, each run under BENCH_TIMEOUT seconds (100 unless set).
bench_rows() {
    local runs=$1 i only=()
    shift
    for row in "$@"; do only+=(--only "$row"); done
    for i in $(seq 1 "$runs"); do
        timeout "${BENCH_TIMEOUT:-100}" python3 -m xlog_actors bench --driver cuda "${only[@]}" --json "$OUT/bench-$i.json" >"$OUT/bench-$i.txt" 2>&1
        echo "bench $i rc=$?"
    done
}
