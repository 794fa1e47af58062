#!/usr/bin/env bash
# Session 38's device calls: bash experiments/results/kernels_s38/call.sh callN, with STEPS (any of
# gtest ab stepab bench tl races) and GTESTS (pytest arguments), ABCONF / ABCTX / WIDTHS / ABROUNDS
# (ab_attention), STEPAB / ABBUDGET / CTX (bench_step --ab), ONLY / BENCHARGS (bench_kernels), TLCONF / TLCTX (timeline_attention),
# RACEPROCS / RACEBUDGET (probe_races) and the *TIMEOUT variables in the environment. Writes under
# $OUT/callN: rev.txt (HEAD and the tree's changes), one log per step, steps.txt, the steps' results
# (archived: results.tgz).
set -u
c=$OUT/$1; mkdir -p "$c"
{ git rev-parse HEAD; git status --short; } > "$c/rev.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$c/rev.txt" 2>&1
for s in ${STEPS:-bench}; do
  t=$(date +%s)
  case $s in
    gtest) timeout ${GTIMEOUT:-300} python3 -m pytest -q -rfE -m gpu -n 8 --dist loadfile \
             ${GTESTS:-tests/kernels tests/test_fast_backend.py} > "$c/gtest.log" 2>&1 ;;
    ab) OUT=$c/ab PYTHONUNBUFFERED=1 timeout ${ABATIMEOUT:-200} python3 experiments/ab_attention.py \
          --configs ${ABCONF:-default,default_again} --contexts ${ABCTX:-16384,65536,196608} \
          --widths ${WIDTHS:-6,8} --rounds ${ABROUNDS:-60} > "$c/ab.log" 2>&1 ;;
    stepab) OUT=$c/stepab PYTHONUNBUFFERED=1 timeout ${ABTIMEOUT:-300} python3 experiments/bench_step.py \
              --budget-s ${ABBUDGET:-150} --no-mini --contexts ${CTX:-8192,65536} --ab $STEPAB > "$c/stepab.log" 2>&1 ;;
    bench) OUT=$c/bench PYTHONUNBUFFERED=1 timeout ${BENCHTIMEOUT:-300} python3 experiments/bench_kernels.py --no-sweep \
             --only ${ONLY:-attention,moe,norm,rope,router,sampler,uniform,linear} ${BENCHARGS:-} > "$c/bench.log" 2>&1 ;;
    tl) OUT=$c/tl PYTHONUNBUFFERED=1 timeout ${TLTIMEOUT:-200} python3 experiments/timeline_attention.py \
          --contexts ${TLCTX:-65536} --configs ${TLCONF:-default,default_again} > "$c/tl.log" 2>&1 ;;
    races) for n in ${RACEPROCS:-1 8}; do OUT=$c/races PYTHONUNBUFFERED=1 timeout ${RACETIMEOUT:-240} python3 \
             experiments/probe_races.py --procs $n --budget-s ${RACEBUDGET:-60} >> "$c/races.log" 2>&1; done ;;
  esac
  echo "$s: exit $? in $(( $(date +%s) - t )) s" | tee -a "$c/steps.txt"
done
dirs=$(cd "$c" && find . -mindepth 1 -maxdepth 1 -type d -printf '%f ')
if [ -n "$dirs" ]; then tar czf "$c/results.tgz" -C "$c" $dirs; fi
