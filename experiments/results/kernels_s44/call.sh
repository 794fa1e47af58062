#!/usr/bin/env bash
# Session 44's device call (the routing folded into the output projection, kernels.routing=folded):
# bash experiments/results/kernels_s44/call.sh callN, with STEPS (any of gtest stepab qual paired bench), GTESTS
# (pytest arguments), PN / PBUDGET / PARMS (the paired replay: requests, tokens, the arms' settings; call 3 ran
# PARMS=candidate.runtime.kernels.routing=folded while rounded was the default: the same comparison), STEPAB / STEPCTX / STEPBUDGET (bench_step.py --ab), ONLY (bench_kernels --no-sweep)
# and the *TIMEOUT variables in the environment. (Calls 1-4 ran with rounded the default and STEPAB's default
# routing_folded; since the flip the default arm is folded and STEPAB's default routing_rounded.) Writes under $OUT/callN: rev.txt, one log per step,
# steps.txt, results.tgz.
set -u
c=$OUT/$1; mkdir -p "$c"
{ git rev-parse HEAD; git status --short; } > "$c/rev.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$c/rev.txt" 2>&1
for s in ${STEPS:-gtest stepab}; do
  t=$(date +%s)
  case $s in
    gtest) timeout ${GTIMEOUT:-200} python3 -m pytest -q -rfE -s -m gpu -n 8 --dist loadfile \
             ${GTESTS:-tests/kernels/test_router_fold.py tests/kernels/test_router_norm.py tests/kernels/test_router.py \
               tests/kernels/test_linear.py tests/test_fast_backend.py} > "$c/gtest.log" 2>&1 ;;
    stepab) OUT=$c/step PYTHONUNBUFFERED=1 timeout ${STEPTIMEOUT:-300} python3 experiments/bench_step.py \
              --budget-s ${STEPBUDGET:-200} --no-mini --contexts ${STEPCTX:-8192,65536} \
              --ab ${STEPAB:-routing_rounded default_again} > "$c/step.log" 2>&1 ;;
    qual) timeout ${QTIMEOUT:-150} python3 -m pytest -q -rfE -s -m gpu -p no:xdist \
            tests/kernels/test_router_fold.py::test_gpu_fold_agreement_with_rounded_router \
            tests/test_fast_backend.py::test_q1_mini_folded_routing_qualification > "$c/qual.log" 2>&1 ;;
    paired) export IQUESTRT_HOME=/tmp/iq   # (traces: .carry/traces, built here: the GPU host has no Hydra)
            timeout ${PTIMEOUT:-380} python3 -m replay.paired control=WORKTREE candidate=WORKTREE runtime.backend=fast \
              runtime.dtype=bfloat16 runtime.device=cuda ${PARMS:-control.runtime.kernels.routing=rounded} \
              requests.n=${PN:-32} requests.select=spread max_new_tokens=${PBUDGET:-128} snapshots.auto_capture=true \
              traces.store=$PWD/.carry/traces progress=false RUN_DIR=$c/run > "$c/paired.log" 2>&1 ;;
    bench) OUT=$c/bench PYTHONUNBUFFERED=1 timeout ${BENCHTIMEOUT:-300} python3 experiments/bench_kernels.py --no-sweep \
             --only ${ONLY:-router,linear} > "$c/bench.log" 2>&1 ;;
  esac
  echo "$s: exit $? in $(( $(date +%s) - t )) s" | tee -a "$c/steps.txt"
done
dirs=$(cd "$c" && find . -mindepth 1 -maxdepth 1 -type d -printf '%f ')
if [ -n "$dirs" ]; then tar czf "$c/results.tgz" -C "$c" $dirs; fi
