#!/usr/bin/env bash
# Session 35's device calls: bash experiments/results/kernels_s35/call.sh callN, with STEPS (any of sweep
# bench) and SWEEP (contexts), SWEEPVAR (--sweep-variants), ROUNDS in the environment. Writes $OUT/callN:
# rev.txt, one log per step, steps.txt, and the steps' result folders (archived: results.tgz).
set -u
c=$OUT/$1; mkdir -p "$c"
{ git rev-parse HEAD; git status --short; } > "$c/rev.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$c/rev.txt" 2>&1
for s in ${STEPS:-sweep bench}; do
  t=$(date +%s)
  case $s in
    sweep) OUT=$c/sweep PYTHONUNBUFFERED=1 timeout ${SWEEPTIMEOUT:-300} python3 experiments/bench_step.py --no-mini \
             --contexts "${CTX-8192,65536}" --sweep ${SWEEP:-8192,16384,32768,65536,131072,196096} \
             --sweep-rounds ${ROUNDS:-40} --sweep-variants ${SWEEPVAR:-attn_ns66} > "$c/sweep.log" 2>&1
           echo "sweep: exit $? in $(( $(date +%s) - t )) s" | tee -a "$c/steps.txt"
           python3 experiments/kernel_report.py --step "$c/sweep" > "$c/sweep_report.log" 2>&1
           echo "sweep report: exit $?" | tee -a "$c/steps.txt" ;;
    bench) OUT=$c/bench PYTHONUNBUFFERED=1 timeout ${BENCHTIMEOUT:-240} python3 experiments/bench_kernels.py --no-sweep > "$c/bench.log" 2>&1
           echo "bench: exit $? in $(( $(date +%s) - t )) s" | tee -a "$c/steps.txt" ;;
  esac
done
dirs=$(cd "$c" && find . -mindepth 1 -maxdepth 1 -type d -printf '%f ')
if [ -n "$dirs" ]; then tar czf "$c/results.tgz" -C "$c" $dirs; fi
