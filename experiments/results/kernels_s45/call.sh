#!/usr/bin/env bash
# Session 45's device call (the expert prefetch, FastModel.expert_prefetch / runtime/kernels/prefetch.py):
# bash experiments/results/kernels_s45/call.sh callN, with STEPS (any of gtest stepab abmoe), GTESTS (pytest arguments),
# STEPAB / STEPCTX / STEPBUDGET (bench_step.py --ab), MOECONF / MOEROUNDS (ab_moe.py) and the *TIMEOUT variables
# in the environment.
# Writes under $OUT/callN: rev.txt, one log per step, steps.txt, results.tgz.
set -u
c=$OUT/$1; mkdir -p "$c"
{ git rev-parse HEAD; git status --short; } > "$c/rev.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$c/rev.txt" 2>&1
for s in ${STEPS:-gtest stepab}; do
  t=$(date +%s)
  case $s in
    gtest) timeout ${GTIMEOUT:-200} python3 -m pytest -q -rfE -m gpu -n 8 --dist loadfile \
             ${GTESTS:-tests/kernels/test_prefetch.py tests/kernels/test_router_fold.py tests/kernels/test_router_norm.py \
               tests/kernels/test_router.py tests/test_fast_backend.py} > "$c/gtest.log" 2>&1 ;;
    stepab) OUT=$c/step PYTHONUNBUFFERED=1 timeout ${STEPTIMEOUT:-300} python3 experiments/bench_step.py \
              --budget-s ${STEPBUDGET:-200} --no-mini --contexts ${STEPCTX:-8192,65536} \
              --ab ${STEPAB:-xpf0 xpf8 xpf16 xpf32 xpf64 xpf16_attn xpf32_attn default_again} > "$c/step.log" 2>&1 ;;
    abmoe) OUT=$c/abmoe PYTHONUNBUFFERED=1 timeout ${MOETIMEOUT:-200} python3 experiments/ab_moe.py \
             --configs ${MOECONF:-sleep10,pf8_sleep10,pf16_sleep10,pf32_sleep10,pf48_sleep10,default} \
             --distinct 38 --rounds ${MOEROUNDS:-40} > "$c/abmoe.log" 2>&1 ;;
  esac
  echo "$s: exit $? in $(( $(date +%s) - t )) s" | tee -a "$c/steps.txt"
done
dirs=$(cd "$c" && find . -mindepth 1 -maxdepth 1 -type d -printf '%f ')
if [ -n "$dirs" ]; then tar czf "$c/results.tgz" -C "$c" $dirs; fi
