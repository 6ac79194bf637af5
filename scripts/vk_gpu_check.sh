#!/usr/bin/env bash
# One device call for the Vulkan backend on the lent NVIDIA GPU: its kernel and engine tests, the
# Python tests against the NumPy reference, then decode / prefill speed through the Python API on
# full-size synthetic 27B files, Vulkan and CUDA in the same process.
#
# The GPU container mounts the compute driver only: no Vulkan loader and no libglvnd. Fetch them
# HERE once (Debian packages, unpacked there; the device tool's README, "Headless rendering"):
#   o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
#   mkdir -p .gl /tmp/amd64/partial && apt-get $o update &&
#     (cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
# Build HERE:  scripts/vk_gpu_check.sh --stage
# Run THERE (device tool, carry [".device", ".gl"]):
#   bash scripts/vk_gpu_check.sh [--no-tests] [--no-bench] [--variants "q1 q2"] [--devices vulkan:int8,vulkan:f32,cuda]
# Logs and JSON go to $OUT (or ./bench/out).
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--stage" ]]; then
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/work/target-cuda}
  rm -rf .device && mkdir -p .device/bin .device/wheels
  python3 scripts/build_cubins.py --arch 90 >/dev/null  # the CUDA rows of the bench use the H200 cubin
  # shader variants to A/B: every directory /tmp/vkvar/<name>/ of .spv files travels as .device/spv-<name>
  for d in /tmp/vkvar/*/; do [[ -d $d ]] && mkdir -p .device/spv-$(basename $d) && cp $d*.spv .device/spv-$(basename $d)/; done
  touch crates/kernels-cuda/build.rs
  scripts/stage_test_bins.sh -p bonsai-kernels-vulkan -p bonsai-engine --test vk_kernels --test vulkan_forward
  MATURIN_PEP517_ARGS= maturin build --profile fastrel -o .device/wheels >/dev/null 2>&1 || echo "wheel build failed"
  echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!bench' || echo '+dirty')" > .device/commit.txt
  tar czf /tmp/bonsai-vk-pkg.tgz .device && rm -rf .device && mkdir .device &&
    mv /tmp/bonsai-vk-pkg.tgz .device/pkg.tgz && du -sh .device/pkg.tgz
  exit 0
fi
[[ -f .device/pkg.tgz ]] && tar xzf .device/pkg.tgz

VKSPV=""; TESTS=1; BENCH=1; PROFILE=1; VARIANTS="q1 q2"; DEVICES="vulkan:int8,vulkan:f32,cuda"; GEN=128; PPREPS=2
while [[ $# -gt 0 ]]; do case "$1" in
  --no-tests) TESTS=0; shift;; --no-profile) PROFILE=0; shift;; --no-bench) BENCH=0; shift;; --variants) VARIANTS="$2"; shift 2;;
  --devices) DEVICES="$2"; shift 2;; --spv) VKSPV="$2"; shift 2;; --gen) GEN="$2"; shift 2;; --pp-reps) PPREPS="$2"; shift 2;;
  *) echo "unknown arg $1"; exit 2;; esac; done
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
LOG="$OUT/vk-check.log"
exec > >(tee -a "$LOG") 2>&1

# the Vulkan loader and libglvnd, unpacked into / (they are not on the machine)
if ! ldconfig -p | grep -q libvulkan.so.1; then
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
# the driver's own ICD manifest when the default one names a library the container lacks
for j in /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json /usr/share/vulkan/icd.d/nvidia_icd.json; do
  if [[ -f $j ]]; then echo "== $j"; cat "$j"; fi
done
if [[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]]; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
fi
export XDG_RUNTIME_DIR=/tmp PYTHONUNBUFFERED=1 BONSAI_CUDA_CACHE=/tmp/bonsai-cuda-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "build $(cat .device/commit.txt)"
export BONSAI_BUILD_COMMIT=$(cat .device/commit.txt)

PY=/tmp/bonsai-py; rm -rf $PY; pip install --no-deps --target $PY .device/wheels/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=$PY
cp $PY/bonsai/_bonsai*.so python/bonsai/ 2>/dev/null  # the tests import the package from python/
rc=0
if (( TESTS )); then
  for t in vk_kernels vulkan_forward; do
    echo "== $t"
    .device/bin/$t --test-threads 1 2>&1 | grep -E "^test |result|panicked|Vulkan|left|right" ; rc=$((rc|${PIPESTATUS[0]}))
  done
  echo "== pytest tests/test_vulkan.py"
  python3 -m pytest -q -x tests/test_vulkan.py -p no:cacheprovider 2>&1 | tail -15; rc=$((rc|${PIPESTATUS[0]}))
fi
# shader variants carried as .device/spv-*/ (BONSAI_VK_SPV_DIR): the mat-vec throughput of each
for d in "" .device/spv-*; do
  [[ -n $d && ! -d $d ]] && continue
  echo "== mv throughput ${d:-embedded}"
  BONSAI_VK_SPV_DIR=$d .device/bin/vk_kernels --ignored --nocapture mv_throughput 2>&1 | grep -E "us per|device|panicked"
done
if (( BENCH )); then
  M=/tmp/bonsai-models; mkdir -p $M; paths=""
  for v in $VARIANTS; do
    [[ -f $M/27b-$v.gguf ]] || python3 -m bonsai.synth --preset 27b --variant $v --out $M/27b-$v.gguf --no-progress
    paths="${paths:+$paths,}$M/27b-$v.gguf"
  done
  if (( PROFILE )); then
    # GPU time per shader over 64 decode steps (timestamps around every dispatch; slower overall)
    for v in $VARIANTS; do
      echo "== vulkan profile, 27b-$v, 8-token prompt + 64 decode steps ${VKSPV:+(shaders from $VKSPV)}"
      BONSAI_VK_SPV_DIR=${VKSPV:-} BONSAI_VK_PROFILE=$OUT/vk-profile-27b-$v.txt python3 -c "
import bonsai, time
e = bonsai.Engine('$M/27b-$v.gguf', device='vulkan', n_ctx=512)
list(e.generate(list(range(3, 11)), max_tokens=64, temperature=0, ignore_eos=True))
del e"
      cat $OUT/vk-profile-27b-$v.txt
    done
  fi
  python3 bench/gpu_api_decode.py --models "$paths" --devices "$DEVICES" --gen $GEN --pp-reps $PPREPS \
    --out "$OUT" --name vulkan-vs-cuda-27b; rc=$((rc|$?))
fi
echo "rc=$rc"
exit $rc
