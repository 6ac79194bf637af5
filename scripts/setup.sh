#!/usr/bin/env bash
# Installs everything bonsai needs on a fresh Debian/Ubuntu machine with Rust and Python ≥3.10,
# builds the wheel and installs it. `--test` adds the test and oracle dependencies
# (llama-cpp-python is built from its sdist: ~10 minutes on 2 cores the first time).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PROFILE=${BONSAI_PROFILE:-fastrel}

command -v cargo >/dev/null || { echo "setup: cargo not found; install Rust (https://rustup.rs) first" >&2; exit 1; }
"$PY" -m pip install -q --upgrade "maturin>=1.9.4,<2" "numpy>=1.24" "aiohttp>=3.9" tqdm
if [[ "${1:-}" == "--test" ]]; then
    "$PY" -m pip install -q "pytest>=8" ruff "openai>=1.40"
    # Vulkan (no GPU needed): lavapipe, Mesa's Vulkan driver on the CPU, runs the Vulkan backend's
    # tests. The shaders ship as committed SPIR-V, so no glslc is needed to build.
    if ! ls /usr/share/vulkan/icd.d/*.json >/dev/null 2>&1; then
        if command -v apt-get >/dev/null; then
            SUDO=$([[ "$(id -u)" == 0 ]] || echo sudo)
            echo "setup: installing lavapipe (mesa-vulkan-drivers) for the Vulkan tests" >&2
            $SUDO apt-get install -y -q mesa-vulkan-drivers libvulkan1 >/dev/null \
                || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q mesa-vulkan-drivers libvulkan1 >/dev/null; }
        else
            echo "setup: no Vulkan driver found; install one (lavapipe: mesa-vulkan-drivers) or the Vulkan tests fail" >&2
        fi
    fi
    # NVRTC (no GPU needed): the tests compile the CUDA kernels for every architecture we ship
    "$PY" -m pip install -q "nvidia-cuda-nvrtc>=13,<14"
    if ! "$PY" -c "import llama_cpp" 2>/dev/null; then
        echo "setup: building llama-cpp-python 0.3.36 from source (the independent oracle; ~10 min on 2 cores)" >&2
        CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
        CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$PY" -m pip install -q llama-cpp-python==0.3.36
    fi
fi
# Editable install: the compiled module lands in python/bonsai/, so the source tree (tests, CLI) and
# the installed package are the same code. `make wheel` builds a release wheel for distribution.
MATURIN_PEP517_ARGS="--profile $PROFILE" "$PY" -m pip install -q --no-deps --no-build-isolation -e .
"$PY" -c "import bonsai, bonsai._bonsai as b; print('setup: bonsai', b.__version__, 'installed')"
