#!/usr/bin/env bash
# On a fresh Debian/Ubuntu machine: installs the build tools, builds the `kvattn` command (with
# the CUDA backend when nvcc is on the machine) and runs `kvattn demo` (on the GPU when one is
# visible, else on the CPU).
#   bash tools/setup_and_demo.sh [demo options, e.g. --requests 32 --device cpu]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null ||
   ! command -v g++ >/dev/null; then
  sudo_cmd=""
  if [ "$(id -u)" -ne 0 ]; then sudo_cmd="sudo"; fi
  $sudo_cmd apt-get update
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y --no-install-recommends \
    cmake ninja-build g++ git
fi

build_dir="${BUILD_DIR:-build}"
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVATTN_BUILD_TESTS=OFF
cmake --build "$build_dir" -j "$(nproc)" --target kvattn_cli
"$build_dir/kvattn" demo "$@"
