#!/usr/bin/env bash
# Builds kvattn with its tests (the CUDA backend and device tests too when nvcc is present) and
# runs the test suite with ctest. Device tests skip themselves on a machine without a GPU (ctest
# shows kvattn_cuda_tests as Skipped).
#   bash tools/run_tests.sh            # build dir: build/
#   BUILD_DIR=out bash tools/run_tests.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build_dir="${BUILD_DIR:-build}"
jobs="${JOBS:-$(nproc)}"

cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVATTN_BUILD_TESTS=ON
cmake --build "$build_dir" -j "$jobs"
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs"
