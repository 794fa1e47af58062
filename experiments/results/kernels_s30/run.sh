#!/usr/bin/env bash
# Session 30's device calls: bash experiments/results/kernels_s30/run.sh callN, with STEPS (any of
# bench stepprof stepab ab tl report gtest), STEPAB (bench_step --ab names), ABCONF (ab_attention configs),
# TLCONF (timeline_attention configs) and GTESTS (pytest arguments) in the environment. Writes
# under $OUT/callN: rev.txt (HEAD and the tree's changes), one log per step, the steps' results.
set -u
c=$OUT/$1; mkdir -p "$c"
{ git rev-parse HEAD; git status --short; } > "$c/rev.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$c/rev.txt" 2>&1
for s in ${STEPS:-bench}; do
  t=$(date +%s)
  case $s in
    bench) OUT=$c/bench PYTHONUNBUFFERED=1 timeout ${BENCHTIMEOUT:-300} python3 experiments/bench_kernels.py --no-sweep > "$c/bench.log" 2>&1 ;;
    stepprof) OUT=$c/stepprof PYTHONUNBUFFERED=1 timeout 200 python3 experiments/bench_step.py --budget-s 60 --no-mini --contexts 8192,65536 --profile > "$c/stepprof.log" 2>&1 ;;
    stepab) OUT=$c/stepab PYTHONUNBUFFERED=1 timeout ${ABTIMEOUT:-300} python3 experiments/bench_step.py --budget-s ${ABBUDGET:-150} --no-mini --contexts 8192,65536 --ab $STEPAB > "$c/stepab.log" 2>&1 ;;
    ab) OUT=$c/ab PYTHONUNBUFFERED=1 timeout ${ABATIMEOUT:-300} python3 experiments/ab_attention.py --configs $ABCONF --contexts ${CTX:-16384,65536,196608} --widths ${WIDTHS:-6,8} --rounds ${ROUNDS:-30} > "$c/ab.log" 2>&1 ;;
    tl) OUT=$c/tl PYTHONUNBUFFERED=1 timeout 300 python3 experiments/timeline_attention.py --contexts ${CTX:-65536,196608} --configs $TLCONF > "$c/tl.log" 2>&1 ;;
    report) python3 experiments/kernel_report.py "$c/bench" $([ -d "$c/stepprof" ] && echo --step "$c/stepprof") > "$c/report.log" 2>&1 ;;
    gtest) timeout ${GTIMEOUT:-300} python3 -m pytest -q -m gpu -n 8 --dist loadfile ${GTESTS:-tests/kernels tests/test_fast_backend.py} > "$c/gtest.log" 2>&1 ;;
  esac
  echo "$s: exit $? in $(( $(date +%s) - t )) s" | tee -a "$c/steps.txt"
done
# at most 8 files come back, 2 folders down: the folders' files travel in one archive
dirs=$(cd "$c" && find . -mindepth 1 -maxdepth 1 -type d -printf '%f ')
if [ -n "$dirs" ]; then tar czf "$c/results.tgz" -C "$c" $dirs && (cd "$c" && rm -rf $dirs); fi
