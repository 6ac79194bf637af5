PY ?= python3
.DEFAULT_GOAL := help

help:  ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

run:  ## set up everything and generate from the demo model (pass MODEL=path for real weights)
	./scripts/setup.sh
	$(PY) -m bonsai generate $(if $(MODEL),--model $(MODEL)) --max-tokens 64 "Write a haiku about a small tree."

dev:  ## build the wheel (fast optimized profile) and install it into $(PY)
	./scripts/setup.sh

test:  ## set up test deps (incl. llama.cpp oracle), then run every test: cargo + pytest
	./scripts/setup.sh --test
	cargo test --workspace --profile test
	$(PY) -m pytest -q tests

lint:  ## rustfmt, clippy -D warnings, rustdoc -D warnings, ruff
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
	$(PY) -m ruff check python tests bench
	$(PY) -m ruff format --check python tests bench

bench:  ## CPU benchmark vs llama.cpp on the small synthetic model (writes bench/results)
	$(PY) -m bonsai bench

sass-diff:  ## SASS of every CUDA kernel, HEAD vs the working tree (NVRTC + cuobjdump, no GPU; BASE=rev; loops: scripts/sass_diff.py --loops)
	$(PY) scripts/sass_diff.py --repeat $(if $(BASE),--base $(BASE))

wheel:  ## release abi3 wheel in target/wheels (CUDA kernels precompiled when NVRTC is found)
	$(PY) scripts/build_cubins.py
	$(PY) -m maturin build --release -o target/wheels

.PHONY: help run dev test lint bench sass-diff wheel
