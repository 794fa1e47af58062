#!/usr/bin/env bash
# Session 57's device call (session 56's, plus `pkern`: experiments/placement_kernels.py with PKARGS; session 59 added `iprobe`: experiments/import_order_kernels.py IPRUNS times with IPARGS; session 60 `isteps`: experiments/import_order_steps.py ISRUNS times with ISARGS): bash experiments/results/kernels_s57/call.sh callN, with STEPS (any of gtest bench step exec paired pairedB placement server pkern iprobe isteps calib; PLARGS / SVARGS: placement.py's / bench_server.py's),
# GTESTS (pytest arguments; default: the whole GPU suite), ONLY (bench_kernels --no-sweep; default: every kernel),
# STEPCTX / STEPBUDGET (bench_step.py --profile), EXECARGS (bench_execution.py), PN / PBUDGET / PARMS (the paired replay: requests, tokens, the arms'
# settings; it needs .carry/traces, built on the CPU host: `IQUESTRT_HOME=H python -m snapshots.traces build
# name=claude400`, then `cp -r H/traces .carry/traces`) and the *TIMEOUT variables in the environment.
# Writes under $OUT/callN: rev.txt, one log per step, steps.txt, results.tgz.
set -u
c=$OUT/$1; mkdir -p "$c"
{ git rev-parse HEAD; git status --short; } > "$c/rev.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$c/rev.txt" 2>&1
for s in ${STEPS:-bench step paired}; do
  t=$(date +%s)
  case $s in
    gtest) timeout ${GTIMEOUT:-260} python3 -m pytest -q -rfE -m gpu -n ${NPROC:-8} --dist loadfile \
             ${GTESTS:-tests/kernels tests/test_fast_backend.py} > "$c/gtest.log" 2>&1 ;;
    bench) OUT=$c/bench PYTHONUNBUFFERED=1 timeout ${BENCHTIMEOUT:-200} python3 experiments/bench_kernels.py --no-sweep \
             --only ${ONLY:-attention,moe,norm,rope,router,sampler,uniform,linear} > "$c/bench.log" 2>&1 ;;
    step) OUT=$c/step PYTHONUNBUFFERED=1 timeout ${STEPTIMEOUT:-150} python3 experiments/bench_step.py \
            --budget-s ${STEPBUDGET:-100} --no-mini --contexts ${STEPCTX:-8192,65536} --profile > "$c/step.log" 2>&1 ;;
    exec) OUT=$c/exec PYTHONUNBUFFERED=1 timeout ${EXECTIMEOUT:-200} python3 experiments/bench_execution.py ${EXECARGS:-} \
            > "$c/exec.log" 2>&1 ;;
    paired) export IQUESTRT_HOME=/tmp/iq
            timeout ${PTIMEOUT:-300} python3 -m replay.paired control=WORKTREE candidate=WORKTREE runtime.backend=fast \
              runtime.dtype=bfloat16 runtime.device=cuda \
              ${PARMS:-candidate.runtime.draft.policy=fixed candidate.runtime.draft.fixed_depth=7} \
              requests.n=${PN:-32} requests.select=spread max_new_tokens=${PBUDGET:-128} snapshots.auto_capture=true \
              traces.store=$PWD/.carry/traces progress=false RUN_DIR=$c/run > "$c/paired.log" 2>&1 ;;
    placement) OUT=$c/placement PYTHONUNBUFFERED=1 timeout ${PLTIMEOUT:-200} python3 experiments/placement.py ${PLARGS:-} \
            > "$c/placement.log" 2>&1 ;;
    server) OUT=$c/server PYTHONUNBUFFERED=1 timeout ${SVTIMEOUT:-200} python3 experiments/bench_server.py ${SVARGS:-} \
            > "$c/server.log" 2>&1 ;;
    pairedB) export IQUESTRT_HOME=/tmp/iq
            timeout ${PTIMEOUT:-300} python3 -m replay.paired control=WORKTREE candidate=WORKTREE runtime.backend=fast \
              runtime.dtype=bfloat16 runtime.device=cuda ${PARMSB:-} \
              requests.n=${PN:-32} requests.select=spread max_new_tokens=${PBUDGET:-128} snapshots.auto_capture=true \
              traces.store=$PWD/.carry/traces progress=false RUN_DIR=$c/runB > "$c/pairedB.log" 2>&1 ;;
    pkern) OUT=$c/pkern PYTHONUNBUFFERED=1 timeout ${PKTIMEOUT:-200} python3 experiments/placement_kernels.py ${PKARGS:-} \
            > "$c/pkern.log" 2>&1 ;;
    iprobe) export IQUESTRT_HOME=/tmp/iq    # session 59's probe: each imported copy's attention on shared data
            for r in ${IPRUNS:-1 2 3}; do OUT=$c/iprobe/r$r PYTHONUNBUFFERED=1 timeout ${IPTIMEOUT:-90} \
              python3 experiments/import_order_kernels.py ${IPARGS:-} >> "$c/iprobe.log" 2>&1; done ;;
    isteps) export IQUESTRT_HOME=/tmp/iq    # session 60's probe: each imported copy's whole decodes of one request
            for r in ${ISRUNS:-1}; do OUT=$c/isteps/r$r PYTHONUNBUFFERED=1 timeout ${ISTIMEOUT:-240} \
              python3 experiments/import_order_steps.py ${ISARGS:-} >> "$c/isteps.log" 2>&1; done ;;
    calib) export IQUESTRT_HOME=/tmp/iq
            PYTHONUNBUFFERED=1 timeout ${CTIMEOUT:-580} python3 experiments/replay_calibration.py revision=WORKTREE out=$c/calib \
              extra="runtime.backend=fast runtime.dtype=bfloat16 runtime.device=cuda snapshots.auto_capture=true traces.store=$PWD/.carry/traces ${CALEXTRA:-}" \
              ${CALARGS:-} > "$c/calib.log" 2>&1 ;;
  esac
  echo "$s: exit $? in $(( $(date +%s) - t )) s" | tee -a "$c/steps.txt"
done
dirs=$(cd "$c" && find . -mindepth 1 -maxdepth 1 -type d -printf '%f ')
if [ -n "$dirs" ]; then tar czf "$c/results.tgz" -C "$c" $dirs && (cd "$c" && rm -rf $dirs); fi
