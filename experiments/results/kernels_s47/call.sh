#!/usr/bin/env bash
# Session 47's device call: bash experiments/results/kernels_s47/call.sh callN, with STEPS (any of gtest bench step),
# GTESTS (pytest arguments; default: the whole GPU suite), ONLY (bench_kernels --no-sweep; default: every kernel),
# STEPCTX / STEPBUDGET (bench_step.py --profile) and the *TIMEOUT variables in the environment.
# Writes under $OUT/callN: rev.txt, one log per step, steps.txt, results.tgz.
set -u
c=$OUT/$1; mkdir -p "$c"
{ git rev-parse HEAD; git status --short; } > "$c/rev.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$c/rev.txt" 2>&1
for s in ${STEPS:-gtest bench step}; do
  t=$(date +%s)
  case $s in
    gtest) timeout ${GTIMEOUT:-260} python3 -m pytest -q -rfE -m gpu -n 8 --dist loadfile \
             ${GTESTS:-tests/kernels tests/test_fast_backend.py tests/test_flashinfer_attention.py} > "$c/gtest.log" 2>&1 ;;
    bench) OUT=$c/bench PYTHONUNBUFFERED=1 timeout ${BENCHTIMEOUT:-200} python3 experiments/bench_kernels.py --no-sweep \
             --only ${ONLY:-attention,moe,norm,rope,router,sampler,uniform,linear} > "$c/bench.log" 2>&1 ;;
    step) OUT=$c/step PYTHONUNBUFFERED=1 timeout ${STEPTIMEOUT:-150} python3 experiments/bench_step.py \
            --budget-s ${STEPBUDGET:-100} --no-mini --contexts ${STEPCTX:-8192,65536} --profile > "$c/step.log" 2>&1 ;;
  esac
  echo "$s: exit $? in $(( $(date +%s) - t )) s" | tee -a "$c/steps.txt"
done
dirs=$(cd "$c" && find . -mindepth 1 -maxdepth 1 -type d -printf '%f ')
if [ -n "$dirs" ]; then tar czf "$c/results.tgz" -C "$c" $dirs; fi
