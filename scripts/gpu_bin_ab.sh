#!/usr/bin/env bash
# Old and new builds of one test binary in alternating processes on the device (for changes that a
# switch inside one process cannot A/B, such as a kernel body): runs `--exact <test>` of
# .device/bin/<old> and .device/bin/<new> in turn, <reps> times each, on the 27B file of each variant,
# printing the lines that match <pattern>. Logs go to $OUT/<label>-<variant>-<side><rep>.log.
# Staged like scripts/gpu_check.sh (.device/pkg.tgz; put the old binary into .device/bin by hand).
#   bash scripts/gpu_bin_ab.sh <label> <old> <new> <test> <reps> <pattern> [variants]
set -uo pipefail
cd "$(dirname "$0")/.."
[[ -f .device/pkg.tgz && ! -d .device/bin ]] && tar xzf .device/pkg.tgz
label=$1 old=$2 new=$3 test=$4 reps=$5 show=$6 variants=${7:-q1}
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
export PYTHONPATH=python PYTHONUNBUFFERED=1 BONSAI_CUDA_CACHE=/tmp/bonsai-cuda-cache
rc=0
for v in $variants; do
  f=/tmp/27b-$v.gguf
  [[ -f $f ]] || python3 -m bonsai.synth --preset 27b --variant $v --out $f >/dev/null 2>&1
  for ((r = 0; r < reps; r++)); do
    for side in old new; do
      bin=$old; [[ $side == new ]] && bin=$new
      echo "[${SECONDS}s] == $label $v $side $r ($bin) =="
      BONSAI_SPEC_BENCH_MODEL=$f .device/bin/$bin --include-ignored --exact "$test" --nocapture 2>&1 \
        | tee "$OUT/$label-$v-$side$r.log" | grep -E "$show|SKIPPED|panicked|result"
      rc=$((rc|${PIPESTATUS[0]}))
    done
  done
done
exit $rc
