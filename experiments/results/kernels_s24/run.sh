#!/bin/bash
# Session 24 device driver (run from the repository root on the GPU machine): $1 = call name.
# STEPS (in order, each with its own log under $OUT/$1):
#   gtest  python3 -m pytest -q -m gpu -n 8 --dist loadfile $GTESTS [-k "$GK" if GK is set]
#   abmoe  experiments/ab_moe.py --configs $MOECFG --distinct $MOEDIST --rounds $MOEROUNDS
#   tlmoe  experiments/timeline_moe.py $TLMOE
#   stepb  experiments/bench_step.py --budget-s $STEPBUDGET --no-mini --contexts ${STEPCTX:-8192,65536} ${STEPPROF:+--profile} --ab $STEPAB
#   bench  experiments/bench_kernels.py --no-sweep --only $BENCH
set -u
O=$OUT/$1; mkdir -p $O
(git rev-parse HEAD; git status --short) > $O/rev.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $O/gpu.txt 2>&1
for s in $STEPS; do
  t0=$(date +%s)
  case $s in
    gtest)
      timeout ${GTIMEOUT:-240} python3 -m pytest -q -m gpu -n ${GN:-8} --dist loadfile ${GTESTS:-tests/kernels/test_moe.py} \
        ${GK:+-k "$GK"} > $O/gtest.log 2>&1; tail -5 $O/gtest.log;;
    abmoe)
      OUT=$O/abmoe timeout ${MOETIMEOUT:-300} python3 experiments/ab_moe.py --configs $MOECFG --distinct ${MOEDIST:-38} \
        --rounds ${MOEROUNDS:-20} > $O/abmoe.log 2>&1; grep -v Warn $O/abmoe.log | tail -30;;
    tlmoe)
      OUT=$O/tlmoe timeout 150 python3 experiments/timeline_moe.py ${TLMOE:-} > $O/tlmoe.log 2>&1
      grep -v Warn $O/tlmoe.log | tail -45;;
    stepb)
      OUT=$O/stepb timeout ${STEPTIMEOUT:-420} python3 experiments/bench_step.py --budget-s ${STEPBUDGET:-150} --no-mini \
        --contexts ${STEPCTX:-8192,65536} ${STEPPROF:+--profile} --ab $STEPAB > $O/stepb.log 2>&1; tail -25 $O/stepb.log;;
    bench)
      OUT=$O/bench timeout 300 python3 experiments/bench_kernels.py --no-sweep --only $BENCH > $O/bench.log 2>&1
      grep -v Warn $O/bench.log | tail -40;;
  esac
  echo "== step $s took $(( $(date +%s) - t0 )) s"
done
