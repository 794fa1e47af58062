#!/usr/bin/env bash
# Issue 4 on one H200: capture all 400 claude400 snapshots for q1-mini, verify every one, run the two
# negative controls, report the time and the store's size. Two device calls back to back (the second
# within the machine's 30 s warm period, so /tmp/iq still holds the snapshots):
#   device run (carry .carry):  bash experiments/snapshots_h200.sh            # capture + verify (partial)
#   device run (carry .carry):  bash experiments/snapshots_h200.sh continue   # verify the rest
# Measured 2026-11-29: capture 251 s, 7.36 GB; verify 203 in the first call, 197 in the second (440 s).
# .carry/traces/claude400 must hold the trace corpus (python -m snapshots.traces build name=claude400,
# then cp -r ~/.cache/iquestrt/traces/claude400 .carry/traces/). Results go to $OUT (or ./out).
set -o pipefail
export PYTHONUNBUFFERED=1
export IQUESTRT_HOME=${IQUESTRT_HOME:-/tmp/iq}
OUT=${OUT:-out}; mkdir -p "$OUT"
VERIFY_BUDGET=${VERIFY_BUDGET:-16}      # tokens decoded per snapshot by verify (both paths)
TOTAL_S=${TOTAL_S:-560}
t0=$(date +%s)
if [ "$1" = continue ]; then
  timeout 560 python3 -m snapshots.verify model=q1-mini traces=claude400 runtime.device=cuda \
      budget=$VERIFY_BUDGET order=shuffle unverified_only=true time_limit_s=500 out="$OUT/verify2.json" \
      > "$OUT/verify2.log" 2>&1
  echo "verify (continued) rc=$? $(( $(date +%s) - t0 )) s"; tail -1 "$OUT/verify2.log"
  python3 -m snapshots.store ls 2>&1 | tail -3
  exit 0
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/env.log"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/env.log"
timeout 330 python3 -m snapshots.capture model=q1-mini traces=claude400 traces_store=.carry/traces \
    runtime.device=cuda progress=false out="$OUT/capture.json" > "$OUT/capture.log" 2>&1
echo "capture rc=$? $(( $(date +%s) - t0 )) s"; tail -4 "$OUT/capture.log"
python3 -m snapshots.store du 2>&1 | tee "$OUT/store_du.log"
python3 -m snapshots.store ls 2>&1 | tail -4
left=$(( TOTAL_S - ($(date +%s) - t0) - 60 ))
timeout $(( left + 40 )) python3 -m snapshots.verify model=q1-mini traces=claude400 runtime.device=cuda \
    budget=$VERIFY_BUDGET order=shuffle time_limit_s=$left out="$OUT/verify.json" > "$OUT/verify.log" 2>&1
echo "verify rc=$? $(( $(date +%s) - t0 )) s"; tail -2 "$OUT/verify.log"
for b in cache_len_off_by_one perturbed_hidden; do
  timeout 60 python3 -m snapshots.verify model=q1-mini traces=claude400 runtime.device=cuda budget=16 \
      limit=2 broken=$b record=false >> "$OUT/negative.log" 2>&1
  echo "negative control $b rc=$?"; tail -1 "$OUT/negative.log"
done
echo "total $(( $(date +%s) - t0 )) s"
