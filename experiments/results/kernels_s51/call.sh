#!/usr/bin/env bash
# Session 51's device call: bash experiments/results/kernels_s51/call.sh callN, with STEPS (any of gtest abpeer stepab tp2),
# GTESTS (pytest arguments; default: the exchange's and the fast backend's GPU tests), ABPEER (ab_peer.py arguments),
# STEPAB / STEPCTX / STEPBUDGET / STEPEXTRA (bench_step.py --ab, more arguments) and the *TIMEOUT variables in the environment.
# Writes under $OUT/callN: rev.txt, one log per step, steps.txt, results.tgz.
set -u
c=$OUT/$1; mkdir -p "$c"
{ git rev-parse HEAD; git status --short; } > "$c/rev.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$c/rev.txt" 2>&1
for s in ${STEPS:-gtest abpeer stepab}; do
  t=$(date +%s)
  case $s in
    gtest) timeout ${GTIMEOUT:-200} python3 -m pytest -q -rfE -m gpu -n ${NPROC:-4} --dist loadfile \
             ${GTESTS:-tests/kernels/test_peer.py tests/kernels/test_linear.py tests/kernels/test_router_norm.py tests/test_fast_backend.py} > "$c/gtest.log" 2>&1 ;;
    abpeer) OUT=$c/abpeer PYTHONUNBUFFERED=1 timeout ${ABTIMEOUT:-150} python3 experiments/ab_peer.py ${ABPEER:-} \
              > "$c/abpeer.log" 2>&1 ;;
    stepab) OUT=$c/step PYTHONUNBUFFERED=1 timeout ${STEPTIMEOUT:-250} python3 experiments/bench_step.py \
              --budget-s ${STEPBUDGET:-150} --no-mini --contexts ${STEPCTX:-8192} ${STEPEXTRA:-} \
              --ab ${STEPAB:-peer_paths peer_fused peer_fused_o_apart} > "$c/step.log" 2>&1 ;;
    tp2) timeout ${TP2TIMEOUT:-200} python3 -m pytest -q -s -rfE -m gpu tests/test_tp2_fast.py ${TP2ARGS:-} > "$c/tp2.log" 2>&1 ;;
  esac
  echo "$s: exit $? in $(( $(date +%s) - t )) s" | tee -a "$c/steps.txt"
done
dirs=$(cd "$c" && find . -mindepth 1 -maxdepth 1 -type d -printf '%f ')
if [ -n "$dirs" ]; then tar czf "$c/results.tgz" -C "$c" $dirs; fi
