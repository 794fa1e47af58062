#!/usr/bin/env bash
# Session 39's device calls: bash experiments/results/kernels_s39/call.sh callN, with STEPS (any of
# fisetup ficheck ab gtest bench) and FICONF (flashinfer_attention.py's check), ABCONF / ABCTX / WIDTHS / ABROUNDS
# (ab_attention), GTESTS (pytest arguments), ONLY / BENCHARGS (bench_kernels --no-sweep) and the *TIMEOUT variables in the environment. fisetup installs
# the FlashInfer wheel carried in .whl (see experiments/flashinfer_attention.py) under /tmp/site and
# puts it on PYTHONPATH for the later steps; its JIT builds land in ~/.cache/flashinfer (kept while the
# machine stays warm). Writes under $OUT/callN: rev.txt, one log per step, steps.txt, results.tgz.
set -u
c=$OUT/$1; mkdir -p "$c"
{ git rev-parse HEAD; git status --short; } > "$c/rev.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$c/rev.txt" 2>&1
export TORCH_CUDA_ARCH_LIST=9.0 FLASHINFER_NVCC_THREADS=2
for s in ${STEPS:-fisetup ficheck}; do
  t=$(date +%s)
  case $s in
    fisetup) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
               .whl/*.whl > "$c/fisetup.log" 2>&1 && export PYTHONPATH=/tmp/site
             { which nvcc; nvcc --version | tail -2; ls ~/.cache/flashinfer 2>&1 | head; } >> "$c/fisetup.log" 2>&1 ;;
    ficheck) PYTHONUNBUFFERED=1 timeout ${FITIMEOUT:-360} python3 experiments/flashinfer_attention.py \
               --configs ${FICONF:-fi_fa2_p16,fi_fa2_p16_sink} > "$c/ficheck.log" 2>&1 ;;
    ab) OUT=$c/ab PYTHONUNBUFFERED=1 timeout ${ABATIMEOUT:-200} python3 experiments/ab_attention.py \
          --configs ${ABCONF:-default,default_again} --contexts ${ABCTX:-16384,65536,196608} \
          --widths ${WIDTHS:-6} --rounds ${ABROUNDS:-60} > "$c/ab.log" 2>&1 ;;
    bench) OUT=$c/bench PYTHONUNBUFFERED=1 timeout ${BENCHTIMEOUT:-420} python3 experiments/bench_kernels.py --no-sweep \
             --only ${ONLY:-attention,moe,norm,rope,router,sampler,uniform,linear} ${BENCHARGS:-} > "$c/bench.log" 2>&1 ;;
    gtest) timeout ${GTIMEOUT:-300} python3 -m pytest -q -rfE -m gpu -n 8 --dist loadfile \
             ${GTESTS:-tests/kernels tests/test_fast_backend.py} > "$c/gtest.log" 2>&1 ;;
  esac
  echo "$s: exit $? in $(( $(date +%s) - t )) s" | tee -a "$c/steps.txt"
done
dirs=$(cd "$c" && find . -mindepth 1 -maxdepth 1 -type d -printf '%f ')
if [ -n "$dirs" ]; then tar czf "$c/results.tgz" -C "$c" $dirs; fi
