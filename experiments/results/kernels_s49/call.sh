#!/usr/bin/env bash
# Session 49's device call: bash experiments/results/kernels_s49/call.sh callN, with STEPS (any of gtest tp2 stepab),
# GTESTS (pytest arguments; default: the whole GPU suite), STEPAB / STEPCTX / STEPBUDGET (bench_step.py --ab) and the
# *TIMEOUT variables in the environment (TP2ARGS: more pytest arguments for tp2). tp2: tests/test_tp2_fast.py alone (its ranks are two more processes on the
# GPU), with its printed numbers.
# Writes under $OUT/callN: rev.txt, one log per step, steps.txt, results.tgz.
set -u
c=$OUT/$1; mkdir -p "$c"
{ git rev-parse HEAD; git status --short; } > "$c/rev.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$c/rev.txt" 2>&1
for s in ${STEPS:-gtest tp2 stepab}; do
  t=$(date +%s)
  case $s in
    gtest) timeout ${GTIMEOUT:-260} python3 -m pytest -q -rfE -m gpu -n 8 --dist loadfile \
             ${GTESTS:-tests/kernels tests/test_fast_backend.py tests/test_flashinfer_attention.py} > "$c/gtest.log" 2>&1 ;;
    tp2) timeout ${TP2TIMEOUT:-200} python3 -m pytest -q -s -rfE -m gpu tests/test_tp2_fast.py ${TP2ARGS:-} > "$c/tp2.log" 2>&1 ;;
    stepab) OUT=$c/step PYTHONUNBUFFERED=1 timeout ${STEPTIMEOUT:-250} python3 experiments/bench_step.py \
              --budget-s ${STEPBUDGET:-150} --no-mini --contexts ${STEPCTX:-8192,65536} \
              --ab ${STEPAB:-peer_paths default_again} > "$c/step.log" 2>&1 ;;
  esac
  echo "$s: exit $? in $(( $(date +%s) - t )) s" | tee -a "$c/steps.txt"
done
dirs=$(cd "$c" && find . -mindepth 1 -maxdepth 1 -type d -printf '%f ')
if [ -n "$dirs" ]; then tar czf "$c/results.tgz" -C "$c" $dirs; fi
