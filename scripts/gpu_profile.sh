#!/usr/bin/env bash
# One device call that looks INSIDE the decode mat-vec and checks the kernels for memory errors:
#   1. which tools the machine has (ncu, compute-sanitizer, cuobjdump need the Firecracker runtime
#      for hardware counters; see the device library's KINDS.md),
#   2. the SASS of the decode mat-vec kernels and their instruction mix (cuobjdump on the cubin),
#   3. Nsight Compute on a few launches of the Q1 / Q2 decode mat-vec at the 27B shapes (speed of
#      light, memory workload, warp stall reasons, scheduler statistics, occupancy),
#   4. compute-sanitizer memcheck and racecheck on the mat-vec, prefill attention and norm kernel tests.
# (3b, with BONSAI_PROFILE_PREFILL=1: the same sections on the prefill hot kernels inside the pp512
# forward; 3c, with BONSAI_PROFILE_GDN=1: the 5-row GDN verify launch against the one-row decode one
# inside the 27B verify round, and racecheck on the fused GDN kernel test.)
# Build HERE first: scripts/gpu_check.sh --stage (it packs the cubin too). Run THERE (device tool,
# repo root, carry [".device"]): bash scripts/gpu_profile.sh [--no-sanitize] (or BONSAI_PROFILE_SANITIZE=0)
# Reports go to $OUT (or ./bench/out).
set -uo pipefail
cd "$(dirname "$0")/.."
SANITIZE=${BONSAI_PROFILE_SANITIZE:-1}
[[ "${1:-}" == "--no-sanitize" ]] && SANITIZE=0
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
[[ -f .device/pkg.tgz && ! -d .device/bin ]] && tar xzf .device/pkg.tgz
export PYTHONPATH=python BONSAI_CUDA_CACHE=/tmp/bonsai-cuda-cache
rep="$OUT/profile.txt"
{
  echo "== device"; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
  echo "== tools"; for t in ncu compute-sanitizer cuobjdump nvdisasm; do echo "$t: $(command -v $t || echo missing)"; done
  ncu --version 2>&1 | tail -1
} | tee "$rep"

# 2. SASS of the decode mat-vecs and their instruction mix
if command -v cuobjdump >/dev/null && ls .device/cubins/*.cubin >/dev/null 2>&1; then
  cuobjdump -sass .device/cubins/*.cubin > "$OUT/all.sass" 2>&1
  python3 - "$OUT/all.sass" <<'PY' | tee -a "$rep"
import re, sys, collections
want = ["mv_q1_n1_r4_k1", "mv_q1_n1_r4_k2", "mv_q2_n1_r2_k1", "mv_q1_n8_k1", "mvp_q1_r4_k1"]
cur, mix = None, collections.defaultdict(collections.Counter)
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"Function : (\w+)", line)
    if m:
        cur = m.group(1) if m.group(1) in want else None
        continue
    if cur:
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m:
            mix[cur][m.group(1).split(".")[0]] += 1
for k in want:
    c = mix.get(k)
    if c:
        print(f"== SASS mix {k}: {sum(c.values())} instructions (static)")
        print("   " + ", ".join(f"{op} {n}" for op, n in c.most_common(24)))
PY
fi

# Nsight Compute on COUNT launches of kernel K after SKIP, with the sections every profile here takes
# and any more --section arguments before the command: ncu_launch OUTFILE K SKIP COUNT [--section S]...
# BINARY ARGS... (environment assignments before the call reach the binary)
ncu_launch() {
  local out=$1 k=$2 skip=$3 count=$4; shift 4
  timeout ${BONSAI_NCU_TIMEOUT:-240} ncu --clock-control none --kernel-name "regex:^$k\$" \
    --launch-skip "$skip" --launch-count "$count" --kill yes \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section SchedulerStats --section Occupancy --section InstructionStats "$@" > "$out" 2>&1
}

# 3. Nsight Compute on the decode mat-vec at the 27B shapes (the sweep binary runs them back to back)
if command -v ncu >/dev/null; then
  for v in q1 q2; do
    f=/tmp/27b-$v.gguf
    [[ -f $f ]] || python3 -m bonsai.synth --preset 27b --variant $v --out $f >/dev/null 2>&1
    k=$([[ $v == q1 ]] && echo "mv_q1_n1_r4_k1" || echo "mv_q2_n1_r2_k1")
    echo "== ncu $k (27B $v)" | tee -a "$rep"
    BONSAI_BENCH_MODEL=$f ncu_launch "$OUT/ncu-$v.txt" "$k" 40 3 --section LaunchStats \
      .device/bin/cuda_mv_sweep --include-ignored --nocapture
    grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Issue Slots|Issued Ipc|No Eligible|Stall|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|Executed Ipc" \
      "$OUT/ncu-$v.txt" | head -60 | tee -a "$rep"
  done
fi

# 3b. the prefill hot kernels inside cuda_bench's pp512 forward (27B q1 and q2): the default GEMM
# of each variant, the row-by-row GDN recurrence and the tensor-core attention; one ncu run per
# kernel, stopped after the profiled launch (each runs cuda_bench's decode part first: about a
# minute per kernel, so only with BONSAI_PROFILE_PREFILL=1)
if [[ "${BONSAI_PROFILE_PREFILL:-0}" == 1 ]] && command -v ncu >/dev/null; then
  for v in q1 q2; do
    f=/tmp/27b-$v.gguf
    [[ -f $f ]] || python3 -m bonsai.synth --preset 27b --variant $v --out $f >/dev/null 2>&1
    if [[ $v == q1 ]]; then ks="gemmh_q1_o4 gdn_step_seq_d128 attn_prefill_tc_hd256"; else ks="gemmh_q2"; fi
    for k in $ks; do
      echo "== ncu $k (27B $v, pp512 forward)" | tee -a "$rep"
      BONSAI_BENCH_MODEL=$f ncu_launch "$OUT/ncu-pp-$v-$k.txt" "$k" 2 1 --section ComputeWorkloadAnalysis \
        .device/bin/cuda_bench --include-ignored --exact cuda_decode_bench --nocapture
      grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Issue Slots|Issued Ipc|No Eligible|Stall|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Shared|Executed Ipc|Pipe" \
        "$OUT/ncu-pp-$v-$k.txt" | head -40 | tee -a "$rep"
    done
  done
fi

# 3c. (BONSAI_PROFILE_GDN=1) the GDN kernels inside the 27B Q1_0 verify round: the 5-row verify
# launch (the producer-warp kernel, the default) against the one-row decode launch, what bounds each
# (cuda_spec_bench's round what-if runs rejected rounds and greedy steps); then racecheck on the
# fused GDN kernel test (the producer kernel's named barriers and shared-memory slots)
if [[ "${BONSAI_PROFILE_GDN:-0}" == 1 ]] && command -v ncu >/dev/null; then
  f=/tmp/27b-q1.gguf
  [[ -f $f ]] || python3 -m bonsai.synth --preset 27b --variant q1 --out $f >/dev/null 2>&1
  for k in gdn_conv_step_norm_bn_pw_d128 gdn_conv_step_norm_early_d128; do
    echo "== ncu $k (27B q1, round what-if)" | tee -a "$rep"
    BONSAI_SPEC_BENCH_MODEL=$f ncu_launch "$OUT/ncu-gdn-$k.txt" "$k" 30 1 --section LaunchStats \
      .device/bin/cuda_spec_bench --include-ignored --exact cuda_round_what_if --nocapture
    grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Issue Slots|Issued Ipc|No Eligible|Stall|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Waves" \
      "$OUT/ncu-gdn-$k.txt" | head -40 | tee -a "$rep"
  done
  if command -v compute-sanitizer >/dev/null; then
    timeout ${BONSAI_SANITIZE_TIMEOUT:-240} compute-sanitizer --tool racecheck --error-exitcode 9 .device/bin/gpu_kernels --include-ignored \
      --test-threads 1 --exact gdn_conv_step_equals_conv_then_step > "$OUT/sanitize-racecheck-gdn.txt" 2>&1
    echo "racecheck gdn_conv_step_equals_conv_then_step rc=$? $(grep -E "ERROR SUMMARY|test result" "$OUT/sanitize-racecheck-gdn.txt" | tr '\n' ' ')" | tee -a "$rep"
  fi
fi

# 4. memory errors and races in the mat-vec kernels (kernel tests only: the sanitizer is slow)
if [[ $SANITIZE == 1 ]] && command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer $tool" | tee -a "$rep"
    # the decode mat-vec and the prefill kernels with shared-memory staging
    for t in matvec_lowbit_real_shapes_vs_reference attention_prefill_vs_decode_path rmsnorm_quant_vs_reference; do
      timeout ${BONSAI_SANITIZE_TIMEOUT:-240} compute-sanitizer --tool $tool --error-exitcode 9 .device/bin/gpu_kernels --include-ignored \
        --test-threads 1 --exact $t > "$OUT/sanitize-$tool-$t.txt" 2>&1
      echo "$t rc=$? $(grep -E "ERROR SUMMARY|test result" "$OUT/sanitize-$tool-$t.txt" | tr '\n' ' ')" | tee -a "$rep"
    done
  done
fi
rm -f "$OUT/all.sass"
(cd "$OUT" && f=$(ls ncu-*.txt sanitize-*.txt 2>/dev/null) && [[ -n "$f" ]] && tar czf profile-logs.tgz $f && rm -f $f)
echo "gpu_profile done"
