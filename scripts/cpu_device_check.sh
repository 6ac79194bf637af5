#!/usr/bin/env bash
# The CPU benchmarks on the device machine's CPU (16 cores with AVX-512 on the lent H100 / H200
# hosts), where this machine has 2: bonsai against llama.cpp (llama-cpp-python, built here for a
# generic AVX-512 VNNI x86-64, not -march=native) on the same synthetic files, a thread sweep of
# the 27B Q1_0 decode, and the memory's read bandwidth (bench/membw.py) for the roofline.
#
# Build HERE first (needs network: pip):
#   scripts/cpu_device_check.sh --stage      # wheels into .cpudev/ (git-ignored)
# and run THERE (device tool, repo root, carry [".cpudev"]):
#   bash scripts/cpu_device_check.sh [--quick | --spin-ab | --long-ctx | --prefill-ab]
# --long-ctx compares a second bonsai wheel, staged with BONSAI_AB_WHEEL=<old.whl> --stage, with
# this one and llama.cpp by prompt length (bench/cpu_long_context.py; LONGCTX_SMALL / LONGCTX_27B
# the comma lists of prompt lengths).
# --prefill-ab runs bench/cpu_prefill_threads.py (prefill by thread count, time outside the parallel
# loops) for the staged baseline wheel, this one, and this one with BONSAI_CPU_MALLOC=0, in
# alternating processes; it needs no llama.cpp (stage with LLAMA_CPP_WHEEL=none).
# Results (JSON + Markdown) go to $OUT (or ./bench/out when $OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--stage" ]]; then
  rm -rf .cpudev && mkdir -p .cpudev/wheels .cpudev/lib
  # bonsai: the development wheel (same fastrel profile as the local CPU benches)
  MATURIN_PEP517_ARGS= CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/work/target} \
    maturin build --profile fastrel -o .cpudev/wheels >/dev/null || { echo "bonsai wheel failed"; exit 1; }
  # llama-cpp-python without -march=native (this machine's AVX-512 set need not be the device's)
  lcp=${LLAMA_CPP_WHEEL:-}
  if [[ "$lcp" == none ]]; then
    echo "no llama-cpp-python staged (only --prefill-ab runs without it)"
  elif [[ -z "$lcp" ]]; then
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON" \
      pip wheel --no-deps --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python==0.3.36" -w .cpudev/wheels \
      || { echo "llama-cpp-python wheel failed"; exit 1; }
  else
    cp "$lcp" .cpudev/wheels/
  fi
  # its pure-Python dependencies (the device has no network); numpy is there already (synth)
  pip download -q --no-deps --only-binary :all: -d .cpudev/wheels diskcache jinja2 typing_extensions \
    || { echo "pip download failed"; exit 1; }
  # MarkupSafe has a pure-Python fallback in its sdist-free wheels only per interpreter: take a few
  for py in 3.10 3.11 3.12 3.13; do
    pip download -q --no-deps --only-binary :all: --python-version $py --platform manylinux2014_x86_64 \
      -d .cpudev/wheels markupsafe || true
  done
  # the baseline of --long-ctx
  if [[ -n "${BONSAI_AB_WHEEL:-}" ]]; then
    mkdir -p .cpudev/ab && cp "$BONSAI_AB_WHEEL" .cpudev/ab/
    echo "${BONSAI_AB_COMMIT:-unknown}" > .cpudev/ab/commit.txt  # the baseline's commit, for the JSON
  fi
  # the OpenMP runtime llama.cpp links against, in case the device lacks it
  cp -L "$(ldconfig -p | awk '/libgomp.so.1 .*x86-64/ {print $NF; exit}')" .cpudev/lib/ 2>/dev/null || true
  echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!bench' || echo '+dirty')" > .cpudev/commit.txt
  ls -la .cpudev/wheels .cpudev/lib; du -sh .cpudev
  exit 0
fi

QUICK=0; SPINAB=0; LONGCTX=0; PREFILLAB=0
[[ "${1:-}" == "--quick" ]] && QUICK=1
[[ "${1:-}" == "--spin-ab" ]] && SPINAB=1
[[ "${1:-}" == "--long-ctx" ]] && LONGCTX=1
[[ "${1:-}" == "--prefill-ab" ]] && PREFILLAB=1
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 BONSAI_BUILD_COMMIT=$(cat .cpudev/commit.txt)
P=/tmp/cpudev-py
PKGS="bonsai llama-cpp-python diskcache jinja2 markupsafe typing_extensions"
[[ $PREFILLAB == 1 ]] && PKGS=bonsai
rm -rf $P && pip install -q --no-deps --no-index --find-links .cpudev/wheels --target $P $PKGS 2>&1 | tail -3
ldconfig -p | grep -q libgomp.so.1 || export LD_LIBRARY_PATH=$PWD/.cpudev/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONPATH=$P
{
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|NUMA node\(s\)|L3"
  grep -o -w "avx512f\|avx512_vnni\|avx512bw\|avx512_bitalg\|avx512vbmi" /proc/cpuinfo | sort | uniq -c
  free -g | head -2
} 2>&1 | tee "$OUT/cpu.txt"
# the staged baseline wheel (--long-ctx, --prefill-ab) into $AB, its commit into $BASE_COMMIT
install_ab() {
  AB=/tmp/cpudev-ab
  rm -rf $AB && pip install -q --no-deps --no-index --target $AB .cpudev/ab/*.whl 2>&1 | tail -2
  BASE_COMMIT=$(cat .cpudev/ab/commit.txt 2>/dev/null || echo unknown)
  echo "base: $(ls .cpudev/ab) at $BASE_COMMIT"
}
if [[ $PREFILLAB == 1 ]]; then
  # prefill by thread count: baseline, this build, this build without the allocator settings;
  # builds alternate per model and repetition, one process per (build, thread count)
  install_ab
  M=/tmp/bonsai-cpu-models; mkdir -p $M
  python3 -m bonsai.synth --preset small --variant q1 --out $M/small-q1.gguf >/dev/null 2>&1
  python3 -m bonsai.synth --preset 27b --variant q1 --out $M/27b-q1.gguf >/dev/null 2>&1
  echo "[${SECONDS}s] models ready"
  run_ab() {  # model tokens threads rep
    local name=$(basename "$1" .gguf)
    for b in base new malloc0; do
      local pp=$P cm=$BONSAI_BUILD_COMMIT mal=1
      [[ $b == base ]] && pp=$AB cm=$BASE_COMMIT
      [[ $b == malloc0 ]] && mal=0
      echo "[${SECONDS}s] $name $2 tokens, $b"
      PYTHONPATH=$pp BONSAI_BUILD_COMMIT=$cm BONSAI_CPU_MALLOC=$mal python3 bench/cpu_prefill_threads.py \
        --model "$1" --tokens "$2" --threads "$3" --out "$OUT/cpu16-prefill-ab-$name-$b-r$4.json"
    done
  }
  for r in 1 2; do run_ab $M/small-q1.gguf 512 16,8,4 $r; done
  run_ab $M/27b-q1.gguf 256 16,8 1
  echo "[${SECONDS}s] done"
  exit 0
fi
python3 -c "import bonsai, llama_cpp; print('bonsai', bonsai.__file__, 'llama_cpp', llama_cpp.__version__)" || exit 1

if [[ $LONGCTX == 1 ]]; then
  # prefill and decode by prompt length: the staged baseline wheel ("base"), this build ("new")
  # and llama.cpp, alternating processes; everything bundled into one file
  install_ab
  M=/tmp/bonsai-cpu-models; mkdir -p $M
  python3 -m bonsai.synth --preset small --variant q1 --out $M/small-q1.gguf >/dev/null 2>&1
  echo "[${SECONDS}s] small ready"
  python3 bench/cpu_long_context.py --model $M/small-q1.gguf --build base=$AB --build new=$P --llamacpp \
    --lengths ${LONGCTX_SMALL:-512,2048,8192} --gen 32 --reps 2 --timeout 240 --out "$OUT" --name cpu16-longctx-small-q1
  python3 -m bonsai.synth --preset 27b --variant q1 --out $M/27b-q1.gguf >/dev/null 2>&1
  echo "[${SECONDS}s] 27b ready"
  python3 bench/cpu_long_context.py --model $M/27b-q1.gguf --build base=$AB --build new=$P --llamacpp \
    --lengths ${LONGCTX_27B:-1024} --gen 16 --reps 1 --timeout ${LONGCTX_27B_TIMEOUT:-120} --out "$OUT" --name cpu16-longctx-27b-q1
  (cd "$OUT" && tar czf cpu16-results.tgz --exclude cpu16-results.tgz . && find . -type f ! -name cpu16-results.tgz -delete)
  echo "[${SECONDS}s] done"
  exit 0
fi

if [[ $SPINAB == 1 ]]; then
  # the spinning pool against rayon (bench/cpu_spin_ab.py), then the default against llama.cpp;
  # everything bundled into one file (the device tool brings back at most 8)
  M=/tmp/bonsai-cpu-models; mkdir -p $M
  python3 -m bonsai.synth --preset small --variant q1 --out $M/small-q1.gguf >/dev/null 2>&1
  python3 -m bonsai.synth --preset 27b --variant q1 --out $M/27b-q1.gguf >/dev/null 2>&1
  echo "[${SECONDS}s] models ready"
  BONSAI_CPU_PAR_STATS=1 python3 bench/cpu_spin_ab.py --models $M/small-q1.gguf --reps 3 --gen 64 \
    --prompt-lengths 16,64 --out "$OUT" --name cpu16-spin-ab-small 2> "$OUT/spin-ab-small-stats.log"
  BONSAI_CPU_PAR_STATS=1 python3 bench/cpu_spin_ab.py --models $M/27b-q1.gguf --reps 3 --gen 16 \
    --prompt-lengths 16,32 --out "$OUT" --name cpu16-spin-ab-27b 2> "$OUT/spin-ab-27b-stats.log"
  echo "[${SECONDS}s] == with the default pool, against llama.cpp =="
  python3 -m bonsai bench --models $M --out "$OUT" --variants q1 --name cpu16-small-q1 2>&1 | grep "^| q1"
  python3 -m bonsai bench --preset 27b --variants q1 --gen 16 --prompt-lengths 16,32,64 --models $M --out "$OUT" \
    --name cpu16-27b-q1 2>&1 | grep "^| q1"
  (cd "$OUT" && tar czf cpu16-results.tgz --exclude cpu16-results.tgz . && find . -type f ! -name cpu16-results.tgz -delete)
  echo "[${SECONDS}s] done"
  exit 0
fi

echo "[${SECONDS}s] == memory read bandwidth =="
python3 bench/membw.py --workers "1,4,8,$(nproc)" --mib 1024 --repeat 5 --out "$OUT/cpu16-membw.json"

M=/tmp/bonsai-cpu-models; mkdir -p $M
echo "[${SECONDS}s] == small model, bonsai vs llama.cpp, all cores =="
python3 -m bonsai bench --models $M --out "$OUT" --name cpu16-small 2>&1 | grep -v "^bench: generating"

echo "[${SECONDS}s] == 27B Q1_0, bonsai vs llama.cpp, all cores =="
python3 -m bonsai.synth --preset 27b --variant q1 --out $M/27b-q1.gguf >/dev/null 2>&1
echo "[${SECONDS}s] 27b q1 synth done"
python3 -m bonsai bench --preset 27b --variants q1 --gen 16 --prompt-lengths 16,32,64 --models $M --out "$OUT" --name cpu16-27b-q1

if [[ $QUICK == 0 ]]; then
  echo "[${SECONDS}s] == 27B Q1_0 bonsai decode by thread count =="
  for t in 4 8 12; do
    python3 -m bonsai bench --preset 27b --variants q1 --gen 16 --prompt-lengths 16,32 --no-peer --threads $t \
      --models $M --out "$OUT" --name cpu16-27b-q1-t$t 2>&1 | grep "| q1 |"
  done
  echo "[${SECONDS}s] == 27B ternary (64-block Q2_0), bonsai vs llama.cpp, all cores =="
  python3 -m bonsai.synth --preset 27b --variant q2g64 --out $M/27b-q2g64.gguf >/dev/null 2>&1
  python3 -m bonsai bench --preset 27b --variants q2g64 --gen 8 --prompt-lengths 16,32 --models $M --out "$OUT" --name cpu16-27b-q2g64
fi
echo "[${SECONDS}s] done"
