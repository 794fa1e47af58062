#!/usr/bin/env bash
# The device tool copies the working tree (tracked and untracked-not-ignored files, plus carry) to the GPU
# machine, at most 64 MiB. Tracked files alone are ~62 MiB since session 57, 38 of them raw results under
# experiments/results. For a call that needs none of them:
#   bash experiments/device_slim.sh out     # move the largest results folders to $SLIM (default /tmp/iqrt-slim)
#   ... the device call ...
#   bash experiments/device_slim.sh back    # move them back (or: git checkout -- experiments/results)
# Nothing is committed this way: the folders are tracked, and `git status` shows them deleted while out.
set -eu
cd "$(git rev-parse --show-toplevel)"
slim=${SLIM:-/tmp/iqrt-slim}
n=${SLIM_N:-6}          # how many of the largest folders to move
case ${1:-} in
  out) mkdir -p "$slim"
       for d in $(du -s experiments/results/*/ | sort -rn | head -n "$n" | cut -f2); do
         d=${d%/}; mv "$d" "$slim/"; echo "out: $d"; done
       git ls-files -z | xargs -0 -r stat -c %s 2>/dev/null | awk '{s+=$1} END {printf "tracked files present: %.1f MiB\n", s/1048576}' ;;
  back) for d in "$slim"/*/; do [ -d "$d" ] || continue; b=$(basename "$d"); mv "$d" "experiments/results/$b"; echo "back: $b"; done
        git status --short -- experiments/results | head -3 ;;
  *) sed -n 2,9p "$0"; exit 2 ;;
esac
