#!/usr/bin/env bash
# Build test binaries without running them and copy each, stripped, to .device/bin/<test name>:
#   scripts/stage_test_bins.sh <cargo test args…>   (e.g. -p bonsai-engine --test cuda_forward)
# Used by gpu_check.sh and vk_gpu_check.sh --stage (CARGO_TARGET_DIR as they set it).
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(cargo test --profile fastrel "$@" --no-run --message-format=json 2>/dev/null |
      python3 -c 'import sys,json
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["kind"]==["test"]:
        print(m["executable"])') || { echo "stage_test_bins: cargo test --no-run failed (build error)" >&2; exit 1; }
mkdir -p .device/bin
for f in $out; do n=$(basename "$f" | sed 's/-[0-9a-f]*$//'); cp "$f" ".device/bin/$n"; strip ".device/bin/$n" 2>/dev/null; done
