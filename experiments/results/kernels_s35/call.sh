#!/usr/bin/env bash
# Session 35's device calls: bash experiments/results/kernels_s35/call.sh callN, with STEPS (any of sweep
# prof ab bench) and SWEEP (contexts), SWEEPVAR (--sweep-variants), SWEEPBASE (--sweep-base), ROUNDS in the environment. Writes $OUT/callN:
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
             --sweep-rounds ${ROUNDS:-40} --sweep-variants ${SWEEPVAR:-attn_ns66} ${SWEEPBASE:+--sweep-base $SWEEPBASE} > "$c/sweep.log" 2>&1
           echo "sweep: exit $? in $(( $(date +%s) - t )) s" | tee -a "$c/steps.txt"
           python3 experiments/kernel_report.py --step "$c/sweep" > "$c/sweep_report.log" 2>&1
           echo "sweep report: exit $?" | tee -a "$c/steps.txt" ;;
    prof) OUT=$c/prof PYTHONUNBUFFERED=1 timeout ${PROFTIMEOUT:-300} python3 experiments/bench_step.py --no-mini \
             --contexts "${CTX-32768,196096}" --profile --budget-s 250 > "$c/prof.log" 2>&1
          echo "prof: exit $? in $(( $(date +%s) - t )) s" | tee -a "$c/steps.txt" ;;
    ab) OUT=$c/ab PYTHONUNBUFFERED=1 timeout ${ABTIMEOUT:-200} python3 experiments/ab_attention.py --configs ${ABCONF:-default,default_again} \
          --contexts ${ABCTX:-32768,196608} --widths ${WIDTHS:-6} --rounds ${ABROUNDS:-40} > "$c/ab.log" 2>&1
        echo "ab: exit $? in $(( $(date +%s) - t )) s" | tee -a "$c/steps.txt" ;;
    bench) OUT=$c/bench PYTHONUNBUFFERED=1 timeout ${BENCHTIMEOUT:-240} python3 experiments/bench_kernels.py --no-sweep > "$c/bench.log" 2>&1
           echo "bench: exit $? in $(( $(date +%s) - t )) s" | tee -a "$c/steps.txt" ;;
  esac
done
dirs=$(cd "$c" && find . -mindepth 1 -maxdepth 1 -type d -printf '%f ')
if [ -n "$dirs" ]; then tar czf "$c/results.tgz" -C "$c" $dirs; fi
