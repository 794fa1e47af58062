#!/bin/bash
# Session 17 device driver (run from the repository root on the GPU machine): $1 = call name;
# STEPS = which of tests ptest atests ab tl step bench to run; AB / CTX / TL / STEPAB / BENCH / PT
# name the configs (see experiments/notes/kernels.md, "Session 17")
set -u
O=$OUT/$1; mkdir -p $O
{ git rev-parse HEAD; git status --short; } > $O/rev.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > $O/smi.txt 2>&1
for s in $STEPS; do
  t0=$(date +%s)
  case $s in
    tests) timeout 330 python3 -m pytest -q -m gpu -n 8 --dist loadfile tests/kernels tests/test_fast_backend.py > $O/pytest.log 2>&1; echo "rc=$?" >> $O/pytest.log; tail -2 $O/pytest.log;;
    ptest) timeout 240 python3 -m pytest -q -m gpu -n 8 --dist loadfile $PT > $O/pytest_part.log 2>&1; echo "rc=$?" >> $O/pytest_part.log; tail -4 $O/pytest_part.log;;
    atests) timeout 200 python3 -m pytest -q -m gpu -n 8 --dist loadfile tests/kernels/test_attention.py > $O/pytest_attn.log 2>&1; echo "rc=$?" >> $O/pytest_attn.log; tail -2 $O/pytest_attn.log;;
    ab) OUT=$O/ab timeout 240 python3 experiments/ab_attention.py --configs $AB --contexts ${CTX:-4096,65536,196608} --widths 6 --rounds 30 > $O/ab.log 2>&1; cat $O/ab.log | grep -v Warn;;
    tl) OUT=$O/tl timeout 120 python3 experiments/timeline_attention.py --contexts 65536 --configs $TL > $O/tl.log 2>&1; tail -12 $O/tl.log;;
    step) OUT=$O/step timeout 300 python3 experiments/bench_step.py --budget-s 60 --no-mini --contexts 8192,65536 --ab $STEPAB > $O/step.log 2>&1; tail -25 $O/step.log;;
    bench) OUT=$O/bench timeout 240 python3 experiments/bench_kernels.py --no-sweep --only ${BENCH:-attention} > $O/bench.log 2>&1; tail -30 $O/bench.log;;
  esac
  echo "== step $s took $(( $(date +%s) - t0 )) s"
done
