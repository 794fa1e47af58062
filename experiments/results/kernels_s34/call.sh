# Session 34's device calls: bash experiments/results/kernels_s34/call.sh callN, with ABCONF (ab_attention
# configs), CTX, WIDTHS, ROUNDS, CHECK (1: run _ws_attention.py's correctness check first) and TL (1: then
# its per-block timeline) in the environment. Writes $OUT/callN: rev.txt, check.log / ws_check.json,
# tl.log / ws_timeline.json, ab.log and the ab results (archived).
set -u
c=$OUT/$1; mkdir -p "$c"
{ git rev-parse HEAD; git status --short; } > "$c/rev.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$c/rev.txt" 2>&1
rc=0
if [ "${CHECK:-1}" = 1 ]; then
  t=$(date +%s)
  OUT=$c PYTHONUNBUFFERED=1 timeout ${CHECKTIMEOUT:-240} python3 experiments/_ws_attention.py > "$c/check.log" 2>&1
  rc=$?
  echo "check: exit $rc in $(( $(date +%s) - t )) s" | tee -a "$c/steps.txt"
fi
if [ $rc != 124 ] && [ "${TL:-0}" = 1 ]; then
  t=$(date +%s)
  OUT=$c PYTHONUNBUFFERED=1 timeout ${TLTIMEOUT:-240} python3 experiments/_ws_attention.py --timeline > "$c/tl.log" 2>&1
  rc=$?
  echo "tl: exit $rc in $(( $(date +%s) - t )) s" | tee -a "$c/steps.txt"
fi
if [ $rc != 124 ] && [ -n "${ABCONF:-}" ]; then
  t=$(date +%s)
  mkdir -p "$c/ab"
  OUT=$c/ab PYTHONUNBUFFERED=1 timeout ${ABATIMEOUT:-300} python3 experiments/ab_attention.py --configs $ABCONF \
    --contexts ${CTX:-16384,65536,196608} --widths ${WIDTHS:-6,8} --rounds ${ROUNDS:-100} > "$c/ab.log" 2>&1
  echo "ab: exit $? in $(( $(date +%s) - t )) s" | tee -a "$c/steps.txt"
  tar czf "$c/ab.tgz" -C "$c" ab && rm -rf "$c/ab"
fi
