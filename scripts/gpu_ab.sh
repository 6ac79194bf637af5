#!/usr/bin/env bash
# A/B on the device: the round-cost bench (and optionally the mat-vec sweep) of an alternative
# build next to the staged main build, in the same call on the same GPU.
#
# HERE: stage main (scripts/gpu_check.sh --stage), build the other branch's cuda_spec_bench and
# cuda_mv_sweep in a separate worktree and CARGO_TARGET_DIR, copy them (stripped) into
# .device/alt/ (with its commit in .device/alt/commit.txt) and pack that as .device/alt.tgz. THERE (carry [".device"]):
#   bash scripts/gpu_ab.sh [--sweep] [--decode] [--variants "q1 q2"]
# (--decode: the decode / prefill bench cuda_bench of both builds too; copy it into .device/alt)
# Logs and JSON go to $OUT as ab-{main,alt}-*.{log,json}.
set -uo pipefail
cd "$(dirname "$0")/.."
ARGS="$*"
[[ -f .device/pkg.tgz && ! -d .device/bin ]] && tar xzf .device/pkg.tgz
[[ -f .device/alt.tgz && ! -d .device/alt ]] && tar xzf .device/alt.tgz
SWEEP=0; DECODE=0; VARIANTS="q1 q2"
while [[ $# -gt 0 ]]; do case "$1" in
  --sweep) SWEEP=1; shift;; --decode) DECODE=1; shift;; --variants) VARIANTS="$2"; shift 2;;
  *) echo "unknown arg $1"; exit 2;; esac; done
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
export PYTHONPATH=python BONSAI_CUDA_CACHE=/tmp/bonsai-cuda-cache
rc=0
for v in $VARIANTS; do
  f=/tmp/27b-$v.gguf d=/tmp/27b-$v-dspark.gguf
  [[ -f $f ]] || python3 -m bonsai.synth --preset 27b --variant $v --out $f >/dev/null 2>&1
  [[ -f $d ]] || python3 -m bonsai.synth --drafter --sparse --preset 27b --variant $v --out $d >/dev/null 2>&1
  for b in main alt; do
    dir=.device/bin; [[ $b == alt ]] && dir=.device/alt
    echo "[${SECONDS}s] == $b: round cost $v"
    BONSAI_SPEC_BENCH_OUT="$OUT/ab-$b-spec-$v.json" BONSAI_SPEC_BENCH_MODEL=$f BONSAI_SPEC_BENCH_DRAFTER=$d $dir/cuda_spec_bench --include-ignored --exact cuda_spec_round_cost --nocapture > "$OUT/ab-$b-spec-$v.log" 2>&1
    rc=$((rc|$?))
    grep -E "BENCH (plain|ngram|dspark \(GPU drafter, round graph true)" "$OUT/ab-$b-spec-$v.log" | cut -c1-200
    if [[ $DECODE == 1 ]]; then
      BONSAI_BENCH_OUT="$OUT/ab-$b-decode-$v.json" BONSAI_BENCH_MODEL=$f $dir/cuda_bench --include-ignored --exact cuda_decode_bench --nocapture > "$OUT/ab-$b-decode-$v.log" 2>&1
      rc=$((rc|$?))
      grep -E "^BENCH (PDL|prefill)|PROFILE eager" "$OUT/ab-$b-decode-$v.log" | cut -c1-160
    fi
    if [[ $SWEEP == 1 ]]; then
      BONSAI_BENCH_MODEL=$f $dir/cuda_mv_sweep --include-ignored --nocapture > "$OUT/ab-$b-sweep-$v.log" 2>&1
      rc=$((rc|$?))
      grep -E "SWEEP (b1|mma) " "$OUT/ab-$b-sweep-$v.log" | sed -E 's/\| n1:.*//' | cut -c1-160
    fi
  done
done
# stamp each JSON with the command, the build it came from and the device
python3 scripts/stamp_json.py "$OUT/ab-*.json" "bash scripts/gpu_ab.sh $ARGS" \
  "$(cat .device/commit.txt 2>/dev/null || echo unknown)" \
  "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)" \
  "$(cat .device/alt/commit.txt 2>/dev/null || echo unknown)"
echo "gpu_ab rc=$rc after ${SECONDS}s"
exit $rc
