#!/usr/bin/env bash
# One device call: CUDA kernel tests (mat-vec, prefill GEMM), full-model CUDA-vs-CPU tests on
# tiny/small synthetic models, then the batch-1 decode and pp512 prefill benchmark on full-size
# synthetic 27B files generated on the GPU machine.
#
# Build HERE first (no CUDA needed), then carry .device/:
#   scripts/gpu_check.sh --stage        # builds test binaries into .device/bin
# and run THERE (device tool, repo root, carry [".device"]):
#   bash scripts/gpu_check.sh [--no-bench] [--variants "q1 q2"] [--drafter-only] [--q41-ab] [--draft-ab] [--what-if] [--python] [--prompt-cache] [--api-ab] [--verify-plans] [--b1q-ab] [--b1p-ab] [--rsplit-ab] [--sampled-ab] [--replay-ab] [--norm-ab] [--rf-ab] [--b1q-ahead-ab] [--gdn-pw-ab] [--markov-ab] [--head-tc-ab] [--fork-ab] ...
# Logs and bench JSON go to $OUT (or ./bench/out when $OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--stage" ]]; then
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/work/target-cuda}
  rm -rf .device
  # the H200's cubin embedded (no NVRTC compile there)
  python3 scripts/build_cubins.py --arch 90 || { echo "cubin build failed"; exit 1; }
  # rerun build.rs: its rerun-if-changed paths are absolute, and another worktree building into the
  # same target directory (same crate metadata) leaves its own cubin embedded otherwise — the
  # binaries then fall back to the device's NVRTC (2026-12-02: 1.5-3 % slower decode that way).
  # Both build scripts read CARGO_MANIFEST_DIR when they run (not baked in by env!), so the rerun
  # reads this checkout's cubins/ and shaders/
  touch crates/kernels-cuda/build.rs
  scripts/stage_test_bins.sh -p bonsai-kernels-cuda -p bonsai-engine \
    --test gpu_kernels --test gpu_gemm --test cuda_forward --test cuda_spec --test cuda_round_graph --test cuda_drafter --test cuda_bench --test cuda_spec_bench \
    --test cuda_mv_sweep || { echo "staging the test binaries failed (a build error above)"; exit 1; }
  rm -rf .device/wheels && mkdir -p .device/wheels
  MATURIN_PEP517_ARGS= maturin build --profile fastrel -o .device/wheels >/dev/null 2>&1 || echo "wheel build failed"
  # the cubin itself, for cuobjdump there (scripts/gpu_profile.sh)
  mkdir -p .device/cubins && cp crates/kernels-cuda/cubins/*.cubin .device/cubins/
  # the device copy has no .git: record what was built
  echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!bench' || echo '+dirty')" > .device/commit.txt
  ls -la .device/bin .device/wheels; du -sh .device
  # the test binaries each embed the cubin: carry them compressed (the device tool's copy limit)
  tar czf /tmp/bonsai-device-pkg.tgz .device && rm -rf .device && mkdir .device &&
    mv /tmp/bonsai-device-pkg.tgz .device/pkg.tgz && du -sh .device/pkg.tgz
  exit 0
fi
[[ -f .device/pkg.tgz ]] && tar xzf .device/pkg.tgz

ARGS="$*"
BENCH=1; VARIANTS="q1 q2"; PYCHECK=0; APIAB=0; RUST=1; KERNELS=1; SWEEP=0; PROFILE=0; STAGED=0; WHATIF=0; VPLANS=0; B1QAB=0; B1PAB=0; RSPLITAB=0; SAMPLEDAB=0; REPLAYAB=0; NORMAB=0; RFAB=0; B1QAHEADAB=0; GDNPWAB=0; Q41AB=0; DRAFTAB=0; MARKOVAB=0; HEADTCAB=0; FORKAB=0; DRAFTERONLY=0; PCACHE=0
# stages start only while the call has time left (the device tool stops a command at 600 s, and
# then the bundling below would not run): past BUDGET seconds the rest is skipped and says so
BUDGET=${BONSAI_GPU_BUDGET:-500}
late() { if (( SECONDS > BUDGET )); then echo "SKIPPED $1: ${SECONDS}s used of the ${BUDGET}s budget"; return 0; fi; return 1; }
while [[ $# -gt 0 ]]; do case "$1" in
  --no-bench) BENCH=0; shift;; --variants) VARIANTS="$2"; shift 2;;
  --python) PYCHECK=1; shift;; --prompt-cache) PCACHE=1; shift;; --api-ab) APIAB=1; shift;; --no-kernel-tests) KERNELS=0; shift;; --staged) STAGED=1; shift;; --profile) PROFILE=1; shift;; --no-rust) RUST=0; shift;; --sweep) SWEEP=1; shift;; --what-if) WHATIF=1; shift;; --verify-plans) VPLANS=1; shift;; --b1q-ab) B1QAB=1; shift;; --b1p-ab) B1PAB=1; shift;; --rsplit-ab) RSPLITAB=1; shift;; --sampled-ab) SAMPLEDAB=1; shift;; --replay-ab) REPLAYAB=1; shift;; --norm-ab) NORMAB=1; shift;; --rf-ab) RFAB=1; shift;; --b1q-ahead-ab) B1QAHEADAB=1; shift;; --gdn-pw-ab) GDNPWAB=1; shift;; --q41-ab) Q41AB=1; shift;; --draft-ab) DRAFTAB=1; shift;; --markov-ab) MARKOVAB=1; shift;; --head-tc-ab) HEADTCAB=1; shift;; --fork-ab) FORKAB=1; shift;; --drafter-only) DRAFTERONLY=1; KERNELS=0; shift;;
  *) echo "unknown arg $1"; exit 2;; esac; done

OUT=${OUT:-bench/out}; mkdir -p "$OUT"
export PYTHONPATH=python PYTHONUNBUFFERED=1 BONSAI_CUDA_CACHE=/tmp/bonsai-cuda-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
M=/tmp/bonsai-models; mkdir -p $M
t0=$(date +%s)
mkdir -p $M/dspark   # matching DSpark drafters (random weights) for the speculative tests
for p in tiny small; do for v in q1 q2; do
  [[ -f $M/$p-$v.gguf ]] || python3 -m bonsai.synth --preset $p --variant $v --out $M/$p-$v.gguf >/dev/null
  [[ -f $M/dspark/$p-$v.gguf ]] || python3 -m bonsai.synth --drafter --preset $p --variant $v --out $M/dspark/$p-$v.gguf >/dev/null
done; done
echo "small models: $(( $(date +%s) - t0 ))s"

rc=0
if [[ $RUST == 1 ]]; then
if [[ $DRAFTERONLY == 0 ]]; then
if [[ $KERNELS == 1 ]]; then
echo "[${SECONDS}s] == kernels vs reference =="
# one at a time: the tests share one Gpu and its launch-plan override (the host emulation inside
# each test is threaded); the launch-gap timing last
.device/bin/gpu_kernels --include-ignored --test-threads 1 --skip launch_chain_cost --nocapture 2>&1 | tee "$OUT/kernels.log" | grep -E "^test |SKIPPED|result|panicked" ; rc=$((rc|${PIPESTATUS[0]}))
.device/bin/gpu_kernels --include-ignored --exact launch_chain_cost --nocapture 2>&1 | tee -a "$OUT/kernels.log" | grep -E "LAUNCHGAP|SKIPPED|result|panicked" ; rc=$((rc|${PIPESTATUS[0]}))
fi
echo "[${SECONDS}s] == prefill GEMM vs reference =="
.device/bin/gpu_gemm --include-ignored --test-threads 1 --nocapture 2>&1 | tee "$OUT/gemm.log" | grep -E "^test |gemm |SKIPPED|result|panicked" ; rc=$((rc|${PIPESTATUS[0]}))
echo "[${SECONDS}s] == full model: CUDA vs CPU =="
BONSAI_CUDA_MODELS=$M .device/bin/cuda_forward --include-ignored --test-threads 1 --nocapture 2>&1 | tee "$OUT/forward.log" | grep -E "^test |max|==|NMSE|SKIPPED|result|panicked|differ" ; rc=$((rc|${PIPESTATUS[0]}))
echo "[${SECONDS}s] == speculative round on CUDA (verify records, replay / re-forward rollback, engine) =="
BONSAI_CUDA_MODELS=$M .device/bin/cuda_spec --include-ignored --test-threads 1 --nocapture 2>&1 | tee "$OUT/spec.log" | grep -E "^test |==|NMSE|SKIPPED|result|panicked|differ" ; rc=$((rc|${PIPESTATUS[0]}))
echo "[${SECONDS}s] == the same with the out-projections on b1-plane activations (BONSAI_CUDA_B1P_OUT=1, opt-in) =="
BONSAI_CUDA_B1P_OUT=1 BONSAI_CUDA_MODELS=$M .device/bin/cuda_spec --include-ignored --test-threads 1 --nocapture 2>&1 | tee "$OUT/spec-b1p-out.log" | grep -E "^test |SKIPPED|result|panicked|differ" ; rc=$((rc|${PIPESTATUS[0]}))
echo "[${SECONDS}s] == speculative round as captured graphs (the default; BONSAI_CUDA_ROUND_GRAPH=0 is eager) vs eager =="
BONSAI_CUDA_MODELS=$M .device/bin/cuda_round_graph --include-ignored --test-threads 1 --nocapture 2>&1 | tee "$OUT/round-graph.log" | grep -E "^test |==|SKIPPED|result|panicked|differ" ; rc=$((rc|${PIPESTATUS[0]}))
fi
echo "[${SECONDS}s] == the GPU DSpark drafter vs the host drafter; the Q4_1 kernels' timing =="
BONSAI_Q41_TIMING_OUT="$OUT/q41-timing.json" BONSAI_CUDA_MODELS=$M .device/bin/cuda_drafter --include-ignored --test-threads 1 --nocapture 2>&1 | tee "$OUT/drafter.log" | grep -E "^test |==|mv_q41|mvt_q41|Q41TIME|NMSE|SKIPPED|result|panicked|differ" ; rc=$((rc|${PIPESTATUS[0]}))

fi

if [[ $STAGED == 1 ]]; then
  # every one-row launch on the staged kernels (default: only the long Q2 ones): the engine again
  for t in cuda_forward cuda_spec cuda_round_graph; do
    late "staged $t" && continue
    echo "[${SECONDS}s] == $t with BONSAI_CUDA_MV_STAGED=all =="
    BONSAI_CUDA_MV_STAGED=all BONSAI_CUDA_MODELS=$M .device/bin/$t --include-ignored --test-threads 1 --nocapture 2>&1 | tee "$OUT/staged-$t.log" | grep -E "^test |SKIPPED|result|panicked|differ" ; rc=$((rc|${PIPESTATUS[0]}))
  done
fi

if [[ $BENCH == 1 ]]; then
  for v in $VARIANTS; do
    late "bench $v" && continue
    f=/tmp/27b-$v.gguf
    t0=$(date +%s); [[ -f $f ]] || python3 -m bonsai.synth --preset 27b --variant $v --out $f >/dev/null 2>&1
    echo "[${SECONDS}s] 27b $v synth: $(( $(date +%s) - t0 ))s, $(stat -c %s $f) bytes"
    if [[ $DRAFTERONLY == 0 ]]; then
      BONSAI_BENCH_MODEL=$f BONSAI_BENCH_OUT="$OUT/bench-$v.json" .device/bin/cuda_bench --include-ignored --exact cuda_decode_bench --nocapture 2>&1 | tee "$OUT/bench-$v.log" | grep -E "BENCH|GEMM|PPPROF|SKIPPED|panicked|result"
      rc=$((rc|${PIPESTATUS[0]}))
    fi
    # speculative round cost R on CUDA; the drafter is sparse (zeros): its timing does not depend on values
    d=/tmp/27b-$v-dspark.gguf
    [[ -f $d ]] || python3 -m bonsai.synth --drafter --sparse --preset 27b --variant $v --out $d >/dev/null 2>&1
    BONSAI_SPEC_BENCH_MODEL=$f BONSAI_SPEC_BENCH_DRAFTER=$d BONSAI_SPEC_BENCH_OUT="$OUT/spec-bench-$v.json" .device/bin/cuda_spec_bench --include-ignored --exact cuda_spec_round_cost --nocapture 2>&1 | tee "$OUT/spec-bench-$v.log" | grep -E "BENCH|SKIPPED|panicked|result"
    rc=$((rc|${PIPESTATUS[0]}))
    if [[ $Q41AB == 1 ]] && ! late "q41 tensor-core spec bench $v"; then
      # the drafter's Q4_1 matrices on the tensor-core kernel (opt-in; the dp4a one is the default)
      BONSAI_CUDA_Q41_TC=1 BONSAI_SPEC_BENCH_MODEL=$f BONSAI_SPEC_BENCH_DRAFTER=$d BONSAI_SPEC_BENCH_OUT="$OUT/spec-bench-q41tc-$v.json" .device/bin/cuda_spec_bench --include-ignored --exact cuda_spec_round_cost --nocapture 2>&1 | tee "$OUT/spec-bench-q41tc-$v.log" | grep -E "BENCH|SKIPPED|panicked|result"
      rc=$((rc|${PIPESTATUS[0]}))
    fi
    if [[ $RFAB == 1 ]] && ! late "plain-form spec bench $v"; then
      # the whole DSpark round with the verify and draft mat-vecs in their plain forms (the
      # default before 2026-12-05), against the run above
      BONSAI_CUDA_MV_ROWS_FIRST=0 BONSAI_SPEC_BENCH_MODEL=$f BONSAI_SPEC_BENCH_DRAFTER=$d BONSAI_SPEC_BENCH_OUT="$OUT/spec-bench-rf0-$v.json" .device/bin/cuda_spec_bench --include-ignored --exact cuda_spec_round_cost --nocapture 2>&1 | tee "$OUT/spec-bench-rf0-$v.log" | grep -E "BENCH (plain|dspark)|SKIPPED|panicked|result"
      rc=$((rc|${PIPESTATUS[0]}))
    fi
    if [[ $DRAFTAB == 1 ]] && ! late "draft by context $v"; then
      # the graph draft by context length: unfused, fused per q head, fused per kv head attention,
      # alternating in one process
      BONSAI_DRAFT_CTX_MODEL=$f BONSAI_DRAFT_CTX_DRAFTER=$d BONSAI_DRAFT_CTX_OUT="$OUT/draft-ctx-$v.json" .device/bin/cuda_drafter --include-ignored --exact cuda_draft_by_context --nocapture 2>&1 | tee "$OUT/draft-ctx-$v.log" | grep -E "DRAFTCTX|DRAFTPROF|SKIPPED|panicked|result"
      rc=$((rc|${PIPESTATUS[0]}))
      # DSpark R by context length (draft + verify round + stage against the step at that context)
      BONSAI_SPEC_BENCH_MODEL=$f BONSAI_SPEC_BENCH_DRAFTER=$d BONSAI_SPEC_CTX_OUT="$OUT/spec-ctx-$v.json" .device/bin/cuda_spec_bench --include-ignored --exact cuda_dspark_by_context --nocapture 2>&1 | tee "$OUT/spec-ctx-$v.log" | grep -E "DSPCTX .* context|SKIPPED|panicked|result"
      rc=$((rc|${PIPESTATUS[0]}))
    fi
    if [[ $DRAFTAB == 1 ]]; then
      # the draft's unfused launches (BONSAI_CUDA_DRAFT_FUSED=0: two norm launches, 256-key
      # attention chunks per q head), the fused ones with the attention per q head
      # (BONSAI_CUDA_DRAFT_ATTN=head), then the default (fused, per kv head)
      for side in unfused head kv; do
        late "draft $side spec bench $v" && continue
        fz=1; [[ $side == unfused ]] && fz=0
        at=head; [[ $side == kv ]] && at=kv
        BONSAI_CUDA_DRAFT_FUSED=$fz BONSAI_CUDA_DRAFT_ATTN=$at BONSAI_SPEC_BENCH_MODEL=$f BONSAI_SPEC_BENCH_DRAFTER=$d BONSAI_SPEC_BENCH_OUT="$OUT/spec-bench-draft-$side-$v.json" .device/bin/cuda_spec_bench --include-ignored --exact cuda_spec_round_cost --nocapture 2>&1 | tee "$OUT/spec-bench-draft-$side-$v.log" | grep -E "BENCH|SKIPPED|panicked|result"
        rc=$((rc|${PIPESTATUS[0]}))
      done
    fi
    if [[ $VPLANS == 1 ]]; then
      # the verify mat-vec plans against each other (rows per warp, the 5-row kernels): the same
      # round cost under each; bench/render_cuda.py renders spec-bench-$v-rn*-n5*.json
      for p in "4 0" "4 1" "8 1"; do
        set -- $p
        late "verify plan rn$1 n5$2 $v" && continue
        BONSAI_CUDA_MV_RN=$1 BONSAI_CUDA_MV_N5=$2 BONSAI_SPEC_BENCH_MODEL=$f BONSAI_SPEC_BENCH_DRAFTER=$d BONSAI_SPEC_BENCH_OUT="$OUT/spec-bench-$v-rn$1-n5$2.json" .device/bin/cuda_spec_bench --include-ignored --exact cuda_spec_round_cost --nocapture 2>&1 | tee "$OUT/spec-bench-$v-rn$1-n5$2.log" | grep -E "BENCH ngram|SKIPPED|panicked|result"
        rc=$((rc|${PIPESTATUS[0]}))
      done
    fi
  done
fi
if [[ $WHATIF == 1 ]]; then
  # what each family of launches costs inside the decode graph (the graph without it)
  for v in $VARIANTS; do
    late "what-if $v" && continue
    f=/tmp/27b-$v.gguf; [[ -f $f ]] || python3 -m bonsai.synth --preset 27b --variant $v --out $f >/dev/null 2>&1
    echo "[${SECONDS}s] == launch what-if $v =="
    BONSAI_BENCH_MODEL=$f BONSAI_WHATIF_OUT="$OUT/whatif-$v.json" .device/bin/cuda_bench --include-ignored --exact cuda_launch_what_if --nocapture 2>&1 | tee "$OUT/whatif-$v.log" | grep -E "WHATIF without|SKIPPED|panicked|result"
    rc=$((rc|${PIPESTATUS[0]}))
    # the same for a verify round and the plain greedy step
    BONSAI_SPEC_BENCH_MODEL=$f BONSAI_WHATIF_OUT="$OUT/whatif-round-$v.json" .device/bin/cuda_spec_bench --include-ignored --exact cuda_round_what_if --nocapture 2>&1 | tee "$OUT/whatif-round-$v.log" | grep -E "WHATIF round|SKIPPED|panicked|result"
    rc=$((rc|${PIPESTATUS[0]}))
  done
fi
# one round A/B bench (cuda_spec_bench's TEST) per 27B variant: LABEL (the log and JSON names),
# TEST, the variable that takes the JSON path, the log lines to show, then NAME=VALUE settings
round_ab() {
  local label=$1 test=$2 outvar=$3 show=$4 v f; shift 4
  for v in $VARIANTS; do
    late "$label $v" && continue
    f=/tmp/27b-$v.gguf; [[ -f $f ]] || python3 -m bonsai.synth --preset 27b --variant $v --out $f >/dev/null 2>&1
    echo "[${SECONDS}s] == $label $v =="
    env "$@" BONSAI_SPEC_BENCH_MODEL=$f "$outvar=$OUT/$label-$v.json" .device/bin/cuda_spec_bench --include-ignored --exact "$test" --nocapture 2>&1 | tee "$OUT/$label-$v.log" | grep -E "$show|SKIPPED|panicked|result"
    rc=$((rc|${PIPESTATUS[0]}))
  done
}
# the int8 tensor-core verify against the 5-row b1-plane kernels, then with the out-projections on
# b1-plane activations too (their layouts need BONSAI_CUDA_B1P_OUT=1 at load; the rows set it) (round
# cost, mat-vecs alone, then each mat-vec family's share)
[[ $B1QAB == 1 ]] && round_ab b1q-ab cuda_b1q_round_ab BONSAI_B1Q_OUT "B1Q (rep|without)" BONSAI_CUDA_B1P_OUT=1
# the b1-plane projections (Q1_0; Q2_0 with two code planes) against the dp4a kernels: round,
# step and the mat-vecs alone, alternating in one process
[[ $B1PAB == 1 ]] && round_ab b1p-ab cuda_b1p_round_ab BONSAI_B1P_AB_OUT "B1PAB rep"
# sampling on the device paths: greedy, a top-k draw from each row's best entries, the same
# draw from the whole rows (zero logit bias): round and step, alternating
[[ $SAMPLEDAB == 1 ]] && round_ab sampled-ab cuda_sampled_round_ab BONSAI_SAMPLED_AB_OUT "SAMPLEDAB rep"
[[ $REPLAYAB == 1 ]] && round_ab replay-ab cuda_replay_round_ab BONSAI_REPLAY_AB_OUT "REPLAYAB rep"
[[ $NORMAB == 1 ]] && round_ab norm-ab cuda_norm_p16_round_ab BONSAI_NORM_AB_OUT "NORMAB rep"
# the int8 tensor-core verify's AHEAD form (the default) against the plain one: round and step
[[ $B1QAHEADAB == 1 ]] && round_ab b1q-ahead-ab cuda_b1q_ahead_round_ab BONSAI_B1Q_AHEAD_OUT "B1QAHEAD rep"
# the producer-warp GDN verify kernel (the default since 2026-12-08; BONSAI_CUDA_GDN_PW=0 off) against
# the 128-thread batched-norm one: the engine's speculative tests with it on (spec == plain, graphs
# == eager; gpu_kernels' gdn_conv_step_equals_conv_then_step compares its bits in the kernel tests),
# then round and step alternating in one process
if [[ $GDNPWAB == 1 ]]; then
  for t in cuda_spec cuda_round_graph; do
    late "$t with the producer warps" && continue
    echo "[${SECONDS}s] == $t with BONSAI_CUDA_GDN_PW=1 =="
    BONSAI_CUDA_GDN_PW=1 BONSAI_CUDA_MODELS=$M .device/bin/$t --include-ignored --test-threads 1 --nocapture 2>&1 | tee "$OUT/gdn-pw-$t.log" | grep -E "^test |SKIPPED|result|panicked|differ" ; rc=$((rc|${PIPESTATUS[0]}))
  done
  round_ab gdn-pw-ab cuda_gdn_pw_round_ab BONSAI_GDN_PW_OUT "GDNPW rep"
fi
# the 5-row dp4a verify kernels and the drafter's block mat-vecs rows-first (the default) against
# their plain forms (BONSAI_CUDA_MV_ROWS_FIRST=0): round and step, alternating in one process; then
# the graph draft the same way
# a graph-draft A/B of cuda_drafter (draft_switch_ab) on the 27B files of every variant:
# draft_ab <label> <test> <json env var> <grep pattern>
draft_ab() {
  local label=$1 test=$2 outvar=$3 show=$4
  for v in $VARIANTS; do
    late "$label $v" && continue
    f=/tmp/27b-$v.gguf; d=/tmp/27b-$v-dspark.gguf
    [[ -f $f ]] || python3 -m bonsai.synth --preset 27b --variant $v --out $f >/dev/null 2>&1
    [[ -f $d ]] || python3 -m bonsai.synth --drafter --sparse --preset 27b --variant $v --out $d >/dev/null 2>&1
    echo "[${SECONDS}s] == $label $v =="
    env BONSAI_DRAFT_CTX_MODEL=$f BONSAI_DRAFT_CTX_DRAFTER=$d "$outvar=$OUT/$label-$v.json" .device/bin/cuda_drafter --include-ignored --exact "$test" --nocapture 2>&1 | tee "$OUT/$label-$v.log" | grep -E "$show|SKIPPED|panicked|result"
    rc=$((rc|${PIPESTATUS[0]}))
  done
}
if [[ $RFAB == 1 ]]; then
  round_ab rows-first-ab cuda_rows_first_round_ab BONSAI_RF_AB_OUT "RFAB rep"
  draft_ab draft-rows-first-ab cuda_draft_rows_first_ab BONSAI_DRAFT_RF_OUT DRAFTRF
fi
# the Markov steps in alternating vocabulary orders (the default) against one order: graph draft
[[ $MARKOVAB == 1 ]] && draft_ab draft-markov-ab cuda_draft_markov_alt_ab BONSAI_DRAFT_MARKOV_OUT DRAFTMARKOV
# the drafter's LM head in the tensor-core layout (a load-time choice, BONSAI_CUDA_Q41_TC_HEAD) or
# not: the Markov A/B's graph drafts in alternating processes, head layout off / on, twice
if [[ $HEADTCAB == 1 ]]; then
  for rep in 0 1; do for h in 0 1; do
    export BONSAI_CUDA_Q41_TC_HEAD=$h
    draft_ab head-tc$h-r$rep cuda_draft_markov_alt_ab BONSAI_DRAFT_MARKOV_OUT "DRAFTMARKOV"
  done; done
  unset BONSAI_CUDA_Q41_TC_HEAD
fi
# the row-split dp4a verify kernels (4- and 5-row launches over 2 blocks of 3 rows, off by
# default) against the 5-row kernels: round, step and the mat-vecs alone, alternating; then the
# engine's checks with it on
if [[ $RSPLITAB == 1 ]]; then
  round_ab rsplit-ab cuda_rsplit_round_ab BONSAI_RSPLIT_AB_OUT "RSPLITAB rep"
  for t in cuda_spec cuda_round_graph; do
    late "rsplit $t" && continue
    echo "[${SECONDS}s] == $t with BONSAI_CUDA_MV_RSPLIT=1 =="
    BONSAI_CUDA_MV_RSPLIT=1 BONSAI_CUDA_MODELS=$M .device/bin/$t --include-ignored --test-threads 1 --nocapture 2>&1 | tee "$OUT/rsplit-$t.log" | grep -E "^test |SKIPPED|result|panicked|differ" ; rc=$((rc|${PIPESTATUS[0]}))
  done
fi
if [[ $FORKAB == 1 ]]; then
  # the engine's speculative and drafter checks with the rollback forked (BONSAI_CUDA_FORK=1)
  for t in cuda_spec cuda_round_graph cuda_drafter; do
    late "fork $t" && continue
    echo "[${SECONDS}s] == $t with BONSAI_CUDA_FORK=1 =="
    BONSAI_CUDA_FORK=1 BONSAI_CUDA_MODELS=$M .device/bin/$t --include-ignored --test-threads 1 --nocapture 2>&1 | tee "$OUT/fork-$t.log" | grep -E "^test |SKIPPED|result|panicked|differ" ; rc=$((rc|${PIPESTATUS[0]}))
  done
  # DSpark rounds pipelined as the engine runs them, the rollback replay forked onto the side
  # stream or not (alternating in one process), with the side stream at low priority and at the
  # default (one process each)
  for v in $VARIANTS; do
    f=/tmp/27b-$v.gguf; [[ -f $f ]] || python3 -m bonsai.synth --preset 27b --variant $v --out $f >/dev/null 2>&1
    d=/tmp/27b-$v-dspark.gguf; [[ -f $d ]] || python3 -m bonsai.synth --drafter --sparse --preset 27b --variant $v --out $d >/dev/null 2>&1
    for prio in 1 0; do
      late "fork A/B $v prio $prio" && continue
      echo "[${SECONDS}s] == fork A/B $v, side stream priority low: $prio =="
      BONSAI_CUDA_FORK=1 BONSAI_CUDA_SIDE_PRIO=$prio BONSAI_SPEC_BENCH_MODEL=$f BONSAI_SPEC_BENCH_DRAFTER=$d BONSAI_FORK_AB_OUT="$OUT/fork-ab-$v-prio$prio.json" .device/bin/cuda_spec_bench --include-ignored --exact cuda_dspark_pipelined --nocapture 2>&1 | tee "$OUT/fork-ab-$v-prio$prio.log" | grep -E "FORKAB|SKIPPED|panicked|result"
      rc=$((rc|${PIPESTATUS[0]}))
    done
  done
fi
if [[ $SWEEP == 1 ]]; then
  echo "[${SECONDS}s] == mat-vec launch-plan sweep =="
  for v in $VARIANTS; do
    late "sweep $v" && continue
    f=/tmp/27b-$v.gguf; [[ -f $f ]] || python3 -m bonsai.synth --preset 27b --variant $v --out $f >/dev/null 2>&1
    BONSAI_BENCH_MODEL=$f BONSAI_SWEEP_OUT="$OUT/sweep-$v.json" .device/bin/cuda_mv_sweep --include-ignored --nocapture 2>&1 | tee "$OUT/sweep-$v.log" | grep -E "SWEEP (best|pipe)|SKIPPED|panicked|result"
    rc=$((rc|${PIPESTATUS[0]}))
  done
fi
if [[ $PYCHECK == 1 ]] && ! late "python check"; then
  echo "[${SECONDS}s] == Python API on CUDA =="
  for v in $VARIANTS; do f=/tmp/27b-$v.gguf; [[ -f $f ]] || python3 -m bonsai.synth --preset 27b --variant $v --out $f >/dev/null 2>&1; done
  rm -rf /tmp/bonsai-py && pip install -q --no-deps --target /tmp/bonsai-py .device/wheels/bonsai-*.whl
  PYTHONPATH=/tmp/bonsai-py python3 scripts/gpu_python_check.py 2>&1 | tee "$OUT/python.log"; rc=$((rc|${PIPESTATUS[0]}))
fi
if [[ $PCACHE == 1 ]] && ! late "prompt cache"; then
  # multi-turn chat on the 27B files through the Python API, the prompt cache on and off
  # (bench/prompt_cache.py: TTFT per turn, the answers must be the same tokens)
  echo "[${SECONDS}s] == prompt cache: multi-turn chat, with and without =="
  [[ -d /tmp/bonsai-py ]] || pip install -q --no-deps --target /tmp/bonsai-py .device/wheels/bonsai-*.whl
  for v in $VARIANTS; do
    f=/tmp/27b-$v.gguf; [[ -f $f ]] || python3 -m bonsai.synth --preset 27b --variant $v --out $f >/dev/null 2>&1
    BONSAI_BUILD_COMMIT=$(cat .device/commit.txt) PYTHONPATH=/tmp/bonsai-py python3 bench/prompt_cache.py --model $f \
      --device cuda --system 4000 --user 100 --gen 32 --turns 6 --reps 2 --out "$OUT/cuda-prompt-cache-27b-$v" 2>&1 |
      tee "$OUT/prompt-cache-$v.log"; rc=$((rc|${PIPESTATUS[0]}))
    # three conversations taking turns: the stash against the live conversation only and no cache
    BONSAI_BUILD_COMMIT=$(cat .device/commit.txt) PYTHONPATH=/tmp/bonsai-py python3 bench/prompt_cache.py --model $f \
      --device cuda --system 4000 --user 100 --gen 32 --turns 4 --conversations 3 --reps 2 \
      --out "$OUT/cuda-prompt-cache-interleaved-27b-$v" 2>&1 | tee "$OUT/prompt-cache-interleaved-$v.log"
    rc=$((rc|${PIPESTATUS[0]}))
  done
fi
if [[ $APIAB == 1 ]] && ! late "api a/b"; then
  # the Python API on the 27B files: the default (norm-fed projections held only in the b1-plane
  # layout) against both layouts kept (BONSAI_CUDA_B1P_DP4A=1): decode, pp512, process GPU memory
  echo "[${SECONDS}s] == Python API: b1-plane-only weights against both layouts =="
  m=""; for v in $VARIANTS; do f=/tmp/27b-$v.gguf; [[ -f $f ]] || python3 -m bonsai.synth --preset 27b --variant $v --out $f >/dev/null 2>&1; m="$m${m:+,}$f"; done
  [[ -d /tmp/bonsai-py ]] || pip install -q --no-deps --target /tmp/bonsai-py .device/wheels/bonsai-*.whl
  BONSAI_BUILD_COMMIT=$(cat .device/commit.txt) PYTHONPATH=/tmp/bonsai-py python3 bench/gpu_api_decode.py --models "$m" --devices cuda,cuda:dp4a,cuda --out "$OUT" --name cuda-b1p-only-ab 2>&1 | tee "$OUT/api-ab.log"; rc=$((rc|${PIPESTATUS[0]}))
fi
if [[ $PROFILE == 1 ]] && ! late "profile"; then
  # SASS mix, Nsight Compute and compute-sanitizer in the same call (scripts/gpu_profile.sh)
  OUT="$OUT" bash scripts/gpu_profile.sh; rc=$((rc|$?))
fi
# stamp every JSON with the command, the commit built and the device
python3 scripts/stamp_json.py "$OUT/*.json" "bash scripts/gpu_check.sh $ARGS" \
  "$(cat .device/commit.txt 2>/dev/null || echo unknown)" "$(cat "$OUT/device.txt")"
# at most 8 files come back from the device: logs and reports in one archive, JSON at the top
# unless there are too many (then they go into results.tgz)
(
  cd "$OUT" || exit 0
  rest=$(ls *.log *.tgz 2>/dev/null; ls *.txt 2>/dev/null | grep -v '^device.txt$')
  [[ -n "$rest" ]] && tar czf logs.tgz.new $rest && rm -f $rest && mv logs.tgz.new logs.tgz
  if (( $(ls | wc -l) > 8 )); then tar czf results.tgz *.json && rm -f *.json; fi
  ls
)
echo "gpu_check rc=$rc after ${SECONDS}s"
exit $rc
