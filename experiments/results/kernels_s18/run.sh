#!/bin/bash
# Session 18 device driver (run from the repository root on the GPU machine): $1 = call name.
# STEPS: session 16's steps (tests ptest atests ab tl step bench: see kernels_s16/run.sh) plus
# abmoe (experiments/ab_moe.py with MOECFG configs, MOEDIST distinct experts, MOEROUNDS rounds) and
# prof (bench_step.py --profile at PROFCTX, default 8192).
set -u
O=$OUT/$1; mkdir -p $O
for s in $STEPS; do
  case $s in
    abmoe)
      t0=$(date +%s)
      OUT=$O/abmoe timeout 300 python3 experiments/ab_moe.py --configs $MOECFG --distinct ${MOEDIST:-38,48} \
        --rounds ${MOEROUNDS:-40} > $O/abmoe.log 2>&1; grep -v Warn $O/abmoe.log | tail -40
      echo "== step abmoe took $(( $(date +%s) - t0 )) s";;
    prof)
      t0=$(date +%s)
      OUT=$O/prof timeout 300 python3 experiments/bench_step.py --budget-s 60 --no-mini --contexts ${PROFCTX:-8192} \
        --profile > $O/prof.log 2>&1; grep -v "^\[" $O/prof.log | tail -60
      echo "== step prof took $(( $(date +%s) - t0 )) s";;
    *) STEPS=$s bash experiments/results/kernels_s16/run.sh "$1";;
  esac
done
