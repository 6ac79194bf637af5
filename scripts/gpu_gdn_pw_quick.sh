#!/usr/bin/env bash
# A short device call for the producer-warp GDN verify kernel (`Gpu::gdn_producer`, the default since
# 2026-12-08; BONSAI_CUDA_GDN_PW=1 below keeps it on whatever the default) when device time is scarce: the GDN kernel tests (gdn_conv_step_equals_conv_then_step's norm mode 5 compares
# its bits), the speculative and round-graph tests with it on (spec == plain, graph == eager), then
# the round / step A/B on the 27B files. `gpu_check.sh --gdn-pw-ab` is the full form (every test).
# Run on the device from the repo root with .device carried (scripts/gpu_check.sh --stage here).
set -uo pipefail
cd "$(dirname "$0")/.."
[[ -f .device/pkg.tgz ]] && tar xzf .device/pkg.tgz
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
export PYTHONPATH=python PYTHONUNBUFFERED=1 BONSAI_CUDA_CACHE=/tmp/bonsai-cuda-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
cat .device/commit.txt | tee "$OUT/commit.txt"
M=/tmp/bonsai-models; mkdir -p $M/dspark
for p in tiny small; do for v in q1 q2; do
  [[ -f $M/$p-$v.gguf ]] || python3 -m bonsai.synth --preset $p --variant $v --out $M/$p-$v.gguf >/dev/null
  [[ -f $M/dspark/$p-$v.gguf ]] || python3 -m bonsai.synth --drafter --preset $p --variant $v --out $M/dspark/$p-$v.gguf >/dev/null
done; done
rc=0
echo "[${SECONDS}s] == GDN kernel tests =="
.device/bin/gpu_kernels --include-ignored --test-threads 1 --nocapture gdn_ 2>&1 | tee "$OUT/kernels-gdn.log" | grep -E "^test |SKIPPED|result|panicked" ; rc=$((rc|${PIPESTATUS[0]}))
for t in cuda_spec cuda_round_graph; do
  echo "[${SECONDS}s] == $t with BONSAI_CUDA_GDN_PW=1 =="
  BONSAI_CUDA_GDN_PW=1 BONSAI_CUDA_MODELS=$M .device/bin/$t --include-ignored --test-threads 1 --nocapture 2>&1 | tee "$OUT/gdn-pw-$t.log" | grep -E "^test |SKIPPED|result|panicked|differ" ; rc=$((rc|${PIPESTATUS[0]}))
done
for v in ${VARIANTS:-q1 q2}; do
  f=/tmp/27b-$v.gguf; [[ -f $f ]] || python3 -m bonsai.synth --preset 27b --variant $v --out $f >/dev/null 2>&1
  echo "[${SECONDS}s] == gdn-pw-ab $v =="
  BONSAI_SPEC_BENCH_MODEL=$f BONSAI_GDN_PW_OUT="$OUT/gdn-pw-ab-$v.json" .device/bin/cuda_spec_bench --include-ignored --exact cuda_gdn_pw_round_ab --nocapture 2>&1 | tee "$OUT/gdn-pw-ab-$v.log" | grep -E "GDNPW rep|SKIPPED|panicked|result" ; rc=$((rc|${PIPESTATUS[0]}))
done
echo "[${SECONDS}s] rc=$rc"
exit $rc
