#!/bin/bash
# Session 17 device driver: session 16's (same steps and environment variables, see
# experiments/results/kernels_s16/run.sh and experiments/notes/kernels.md, "Session 17"), run from the
# repository root: STEPS="tests ab" AB=... CTX=... bash experiments/results/kernels_s17/run.sh callN
exec bash "$(dirname "$0")/../kernels_s16/run.sh" "$@"
