#!/bin/bash
# Session 21 device driver (run from the repository root on the GPU machine): $1 = call name.
# STEPS: session 18's steps (kernels_s18/run.sh: tests ptest atests ab tl step bench abmoe prof),
# with their configs in the environment (PT, MOECFG, MOEDIST, STEPAB, BENCH, ...).
set -u
STEPS="$STEPS" bash experiments/results/kernels_s18/run.sh "$1"
