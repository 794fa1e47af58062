#!/usr/bin/env bash
# Session 42's device calls (the stepab variants moe_gu_down* and the ab_moe configs gu_down* live in
# rejected/gu_down_8a2f93e.diff): bash experiments/results/kernels_s42/call.sh callN, with STEPS (any of gtest
# abmoe stepab bench) and GTESTS (pytest arguments), ABMCONF / DISTINCT / ABMROUNDS (ab_moe.py), STEPAB /
# STEPCTX (bench_step.py --ab), ONLY (bench_kernels --no-sweep) and the *TIMEOUT variables in the
# environment. Writes under $OUT/callN: rev.txt, one log per step, steps.txt, results.tgz.
set -u
c=$OUT/$1; mkdir -p "$c"
{ git rev-parse HEAD; git status --short; } > "$c/rev.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$c/rev.txt" 2>&1
for s in ${STEPS:-gtest abmoe}; do
  t=$(date +%s)
  case $s in
    gtest) timeout ${GTIMEOUT:-200} python3 -m pytest -q -rfE -m gpu -n 8 --dist loadfile \
             ${GTESTS:-tests/kernels/test_moe.py} > "$c/gtest.log" 2>&1 ;;
    abmoe) OUT=$c/abmoe PYTHONUNBUFFERED=1 timeout ${ABMTIMEOUT:-200} python3 experiments/ab_moe.py \
             --configs ${ABMCONF:-default,gu_down,gu_down_sliced,default_again} --distinct ${DISTINCT:-38,48} \
             --widths ${WIDTHS:-6} --rounds ${ABMROUNDS:-40} > "$c/abmoe.log" 2>&1 ;;
    stepab) OUT=$c/step PYTHONUNBUFFERED=1 timeout ${STEPTIMEOUT:-300} python3 experiments/bench_step.py \
              --budget-s ${STEPBUDGET:-200} --no-mini --contexts ${STEPCTX:-8192} \
              --ab ${STEPAB:-moe_gu_down moe_gu_down_sliced default_again} > "$c/step.log" 2>&1 ;;
    bench) OUT=$c/bench PYTHONUNBUFFERED=1 timeout ${BENCHTIMEOUT:-420} python3 experiments/bench_kernels.py --no-sweep \
             --only ${ONLY:-moe} > "$c/bench.log" 2>&1 ;;
  esac
  echo "$s: exit $? in $(( $(date +%s) - t )) s" | tee -a "$c/steps.txt"
done
dirs=$(cd "$c" && find . -mindepth 1 -maxdepth 1 -type d -printf '%f ')
if [ -n "$dirs" ]; then tar czf "$c/results.tgz" -C "$c" $dirs; fi
