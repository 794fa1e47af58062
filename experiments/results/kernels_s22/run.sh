#!/bin/bash
# Session 22 device driver (run from the repository root on the GPU machine): $1 = call name.
# STEPS: session 18's steps (kernels_s18/run.sh: tests ptest atests ab tl step bench abmoe prof) plus
# tlmoe (experiments/timeline_moe.py, TLMOE = its extra arguments, e.g. "--gu-split-k 2") and
# stepb (bench_step.py --budget-s $STEPBUDGET --ab $STEPAB).
set -u
O=$OUT/$1; mkdir -p $O
for s in $STEPS; do
  t0=$(date +%s)
  case $s in
    tlmoe)
      n=tlmoe$(echo "${TLMOE:-}" | tr -cd '0-9')
      OUT=$O/$n timeout 120 python3 experiments/timeline_moe.py ${TLMOE:-} > $O/$n.log 2>&1; grep -v Warn $O/$n.log | tail -45;;
    stepb)
      OUT=$O/stepb timeout 420 python3 experiments/bench_step.py --budget-s ${STEPBUDGET:-200} --no-mini \
        --contexts 8192,65536 --ab $STEPAB > $O/stepb.log 2>&1; tail -30 $O/stepb.log;;
    *) STEPS=$s bash experiments/results/kernels_s18/run.sh "$1";;
  esac
  echo "== step $s took $(( $(date +%s) - t0 )) s"
done
