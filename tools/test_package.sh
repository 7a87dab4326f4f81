#!/usr/bin/env bash
# kvattn as a package (issue 17): installs a configured build tree with `cmake --install`, builds
# examples/cpp_engine as a project outside the tree against the installed prefix only
# (find_package(kvattn CONFIG REQUIRED), kvattn::kvattn), runs its C++ engine loop (EXTEND, MIXED
# and DECODE steps) and its C ABI program, and checks that nothing the package links names
# cuBLAS (the installed CMake files, the library's undefined symbols, the executables' shared
# libraries).
#   bash tools/test_package.sh [BUILD_DIR...]     default: build (configured by run_tests.sh)
#   KVATTN_PACKAGE_CPU_ONLY=1 bash tools/test_package.sh build
#       also configures and builds a CPU-only library (build-package-cpu/) and runs the same
#       checks on its package: the CPU-only and the CUDA packages alike.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$(pwd)
jobs="${JOBS:-$(nproc)}"
work=$(mktemp -d /tmp/kvattn-package.XXXXXX)
trap 'rm -rf "$work"' EXIT

build_dirs=("$@")
if [ ${#build_dirs[@]} -eq 0 ]; then build_dirs=(build); fi
if [ "${KVATTN_PACKAGE_CPU_ONLY:-0}" = 1 ]; then
  cmake -S . -B build-package-cpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVATTN_WITH_CUDA=OFF \
    -DKVATTN_BUILD_TESTS=OFF -DKVATTN_BUILD_TOOLS=OFF >/dev/null
  cmake --build build-package-cpu -j "$jobs" --target kvattn
  build_dirs+=(build-package-cpu)
fi

for build_dir in "${build_dirs[@]}"; do
  name=$(basename "$build_dir")
  prefix="$work/prefix-$name"
  echo "== package from $build_dir"
  cmake --build "$build_dir" -j "$jobs" --target kvattn
  cmake --install "$build_dir" --prefix "$prefix" >/dev/null
  (cd "$prefix" && find . -type f | sort | sed 's|^\./|   |')

  # The link interface of the installed package: no cuBLAS anywhere in its CMake files.
  if grep -qi cublas "$prefix"/lib*/cmake/kvattn/*.cmake; then
    echo "FAIL: the installed package names cuBLAS:"; grep -i cublas "$prefix"/lib*/cmake/kvattn/*.cmake
    exit 1
  fi
  link_libs=$(grep -h 'INTERFACE_LINK_LIBRARIES' "$prefix"/lib*/cmake/kvattn/kvattnTargets.cmake)
  echo "   link interface: ${link_libs#*INTERFACE_LINK_LIBRARIES }"
  # ... and the library calls no cuBLAS function.
  if nm -u "$prefix"/lib*/libkvattn.a 2>/dev/null | grep -qi cublas; then
    echo "FAIL: libkvattn.a calls cuBLAS:"; nm -u "$prefix"/lib*/libkvattn.a | grep -i cublas | head
    exit 1
  fi

  # A project outside the tree: a copy of examples/cpp_engine, told only the prefix.
  cp -r "$repo/examples/cpp_engine" "$work/app-$name"
  cmake -S "$work/app-$name" -B "$work/app-$name/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$prefix" | grep -- '-- kvattn'
  cmake --build "$work/app-$name/build" -j "$jobs" >/dev/null
  for exe in engine_loop engine_step_c; do
    if ldd "$work/app-$name/build/$exe" | grep -qi cublas; then
      echo "FAIL: $exe loads cuBLAS"; ldd "$work/app-$name/build/$exe"; exit 1
    fi
  done
  echo "   engine_loop links: $(ldd "$work/app-$name/build/engine_loop" | awk '{print $1}' | tr '\n' ' ')"
  "$work/app-$name/build/engine_loop" | tail -1
  "$work/app-$name/build/engine_step_c"
done
echo "package: OK (${build_dirs[*]})"
