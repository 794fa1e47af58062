#!/usr/bin/env bash
# Session 58, call 3: A/A replays alternating between the default arm order (control, candidate, aa imported and
# built in that order) and the swapped one (import_order=[candidate,control,aa]), one replay at a time, so that
# the two orders share the machine and its drift. bash experiments/results/kernels_s58/alternate.sh NAME [BUDGET_S]
# Writes $OUT/NAME/{def,swp}/runs/aa-NNN (datasets 70+k default, 60+k swapped), their logs, results.tgz.
set -u
c=$OUT/$1; budget=${2:-460}; mkdir -p "$c"
{ git rev-parse HEAD; git status --short; } > "$c/rev.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$c/rev.txt" 2>&1
export IQUESTRT_HOME=/tmp/iq PYTHONUNBUFFERED=1
E="runtime.backend=fast runtime.dtype=bfloat16 runtime.device=cuda snapshots.auto_capture=true traces.store=$PWD/.carry/traces"
A="n_aa=1 n_slow=0 n_policy=0 slowdown=0.01 requests=32 max_new_tokens=128 select=spread"
t0=$(date +%s)
for k in 0 1 2 3 4 5; do
  for o in def swp; do
    [ $(( $(date +%s) - t0 )) -gt "$budget" ] && break 2
    if [ $o = swp ]; then X="import_order=[candidate,control,aa]"; s=$((60 + k)); else X=""; s=$((70 + k)); fi
    t=$(date +%s)
    timeout 200 python3 experiments/replay_calibration.py revision=WORKTREE out="$c/$o" extra="$E $X" $A start=$s \
      >> "$c/$o.log" 2>&1
    echo "$o start=$s: exit $? in $(( $(date +%s) - t )) s" | tee -a "$c/steps.txt"
  done
done
tar czf "$c/results.tgz" -C "$c" def swp 2>/dev/null && rm -rf "$c/def" "$c/swp"
