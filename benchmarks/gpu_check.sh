#!/usr/bin/env bash
# The one command for a GPU machine (benchmarks/README.md, "GPU check"); about 5 minutes on an
# H200 when the prebuilt FlashInfer kernels load:
#   1. unpack the FlashInfer bundle (.gpu/fi_site_aot.tar.xz) into $SITE
#   2. a `kvpark` shim package (the checkout is not installed there)
#   3. FlashInfer's smoke test with FLASHINFER_DISABLE_JIT=1; if the prebuilt kernels do not
#      load, everything after runs with JIT allowed (5-8 minutes of kernel builds)
#   4. pytest -m gpu tests/gpu
#   5. benchmarks/gpu_bench.py
# Results, logs and a status summary go to $OUT (default benchmarks/results/). Every step runs
# under a share of $BUDGET_S, so the script ends (and says what it could not do) inside a
# 10-minute command limit. Prepare the tree first with benchmarks/gpu_prepare.sh.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-benchmarks/results}
SITE=${SITE:-/tmp/site}
SHIM=${SHIM:-/tmp/kvpark_shim}
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-560}
mkdir -p "$OUT"
STATUS="$OUT/gpu_check_status.txt"
: > "$STATUS"
failures=0

record() {  # step, outcome
    echo "$1: $2 (at ${SECONDS}s)" | tee -a "$STATUS"
    [ "$2" = ok ] || failures=$((failures + 1))
}

remaining() {  # seconds left for a step that wants at most $1
    local left=$((BUDGET_S - SECONDS))
    [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}

run_step() {  # name, max seconds, log file, command...
    local name=$1 limit log=$3
    limit=$(remaining "$2")
    shift 3
    if [ "$limit" -le 10 ]; then
        record "$name" "skipped (time budget spent)"
        return 1
    fi
    echo "== $name (up to ${limit}s) -> $log"
    timeout "$limit" "$@" > "$log" 2>&1
    local rc=$?
    tail -n 25 "$log"
    if [ "$rc" -eq 0 ]; then record "$name" ok; else record "$name" "failed rc=$rc"; fi
    return "$rc"
}

{ nvidia-smi || true; "$PY" -c "import torch, triton; print('torch', torch.__version__,
  'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

# 1. the FlashInfer bundle
if [ -d "$SITE/flashinfer" ] || { mkdir -p "$SITE" && tar -C "$SITE" -xJf .gpu/fi_site_aot.tar.xz; }
then record unpack ok; else record unpack "failed: is .gpu/fi_site_aot.tar.xz there?"; fi

# 2. kvpark from the checkout; never the checkout itself on PYTHONPATH: its top-level
#    operator/ would shadow the standard library's operator and Python would not start
if "$PY" benchmarks/_kvpark_path.py "$SHIM" > /dev/null; then record shim ok
else record shim failed; fi
export PYTHONPATH="$SITE:$SHIM" PYTHONUNBUFFERED=1 FLASHINFER_DISABLE_JIT=1
if ! "$PY" -c "import pytest" 2> /dev/null; then
    export PYTHONPATH="$PYTHONPATH:$PWD/.gpu/pylib"  # pytest carried by gpu_prepare.sh
fi

# 3. smoke test on the prebuilt kernels; fall back to JIT builds if they do not load
if ! run_step "fi_smoke (prebuilt kernels)" 240 "$OUT/fi_smoke.log" "$PY" .gpu/fi_smoke.py; then
    unset FLASHINFER_DISABLE_JIT
    echo "prebuilt kernels failed: JIT builds allowed from here on" | tee -a "$STATUS"
    run_step "fi_smoke (JIT)" 480 "$OUT/fi_smoke_jit.log" "$PY" .gpu/fi_smoke.py
fi

# 4. the GPU tests (-P: the working directory stays off sys.path, see step 2; -rsP: skip reasons,
#    and what passing tests print: the measured logits errors and greedy agreements)
run_step "pytest tests/gpu" 200 "$OUT/gpu_tests.log" "$PY" -P -m pytest -m gpu tests/gpu -q \
    -rsP -p no:cacheprovider --junitxml "$OUT/gpu_tests.xml"

# 5. benchmarks
run_step "gpu_bench" 200 "$OUT/gpu_bench.log" "$PY" benchmarks/gpu_bench.py --out "$OUT"

echo "== summary ($failures not ok, ${SECONDS}s)"
cat "$STATUS"
[ -f "$OUT/gpu_bench.md" ] && cat "$OUT/gpu_bench.md"
[ "$failures" -eq 0 ]
