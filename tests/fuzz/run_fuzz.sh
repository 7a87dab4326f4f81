#!/usr/bin/env bash
# Builds the libFuzzer target (clang, ASan + UBSan, CPU only) and fuzzes for a bounded time,
# starting from the seed corpus in tests/fuzz/corpus (read-only: new inputs go to a scratch copy).
# Any crash, sanitizer report, leak or timeout fails the run (exit code != 0) and leaves the
# reproducer as crash-*/leak-*/timeout-* in the fuzz build directory.
#   bash tests/fuzz/run_fuzz.sh            # 60 s
#   FUZZ_SECONDS=600 bash tests/fuzz/run_fuzz.sh
#   bash tests/fuzz/run_fuzz.sh path/to/crash-file   # replays inputs only
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
build_dir="${FUZZ_BUILD_DIR:-build-fuzz}"
seconds="${FUZZ_SECONDS:-60}"
jobs="${JOBS:-2}"

cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DKVATTN_WITH_CUDA=OFF \
  -DKVATTN_BUILD_TESTS=OFF -DKVATTN_BUILD_TOOLS=OFF -DKVATTN_BUILD_FUZZ=ON
cmake --build "$build_dir" -j "$jobs" --target kvattn_fuzz_batch

root="$(pwd)"
fuzzer="$root/$build_dir/kvattn_fuzz_batch"
if [ "$#" -gt 0 ]; then
  exec "$fuzzer" "$@"
fi
work="$root/$build_dir/fuzz-corpus"
rm -rf "$work"
mkdir -p "$work"
cd "$root/$build_dir"  # crash-* reproducers land here
# -rss_limit_mb: a planner that allocates without bound fails the run; -timeout: one input may
# take at most 10 s (they take well under a millisecond).
"$fuzzer" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -max_len=2048 \
  -print_final_stats=1 "$work" "$root/tests/fuzz/corpus"
