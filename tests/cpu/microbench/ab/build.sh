#!/usr/bin/env bash
# In-process A/B of cpu::run_attention (not part of the test build): the CPU kernels of a base
# revision (default HEAD) and of the working tree, linked into one binary, called alternately on
# the same inputs (causal prefill or, with len 1, decode-shaped calls). On the shared 2-core VM
# the speed of a core moves by up to 2x between runs minutes apart; alternating calls in one
# process is what makes two versions comparable.
#
#   bash tests/cpu/microbench/ab/build.sh [BASE_REV]     (from the repo root; builds build-cpu)
#   /tmp/kvattn_ab/ab BATCH LEN THREADS REPS [HEAD_DIM] [prefill|decode1|decode16|hot]
set -euo pipefail
base=${1:-HEAD}
out=/tmp/kvattn_ab
rm -rf "$out" && mkdir -p "$out/base"
git archive "$base" src include | tar -x -C "$out/base"
flags=(-O3 -std=c++20 -mavx2 -mfma -mf16c)
# The base library with its namespace renamed, so both versions link into one binary.
for f in "$out"/base/src/core/*.cpp "$out"/base/src/cpu/*.cpp; do
  g++ "${flags[@]}" -Dkvattn=kvattnold -I"$out/base/src" -I"$out/base/include" -c "$f" \
    -o "$out/$(basename "$(dirname "$f")")_$(basename "$f" .cpp).o"
done
ar rcs "$out/libbase.a" "$out"/*.o
cmake --build build-cpu --target kvattn >/dev/null
here=tests/cpu/microbench/ab
g++ "${flags[@]}" -DSIDE=run_new -Isrc -Iinclude -c $here/side.cpp -o "$out/new_side.o"
g++ "${flags[@]}" -DSIDE=run_old -Dkvattn=kvattnold -I"$out/base/src" -I"$out/base/include" \
  -c $here/side.cpp -o "$out/old_side.o"
g++ -O3 $here/main.cpp "$out/new_side.o" "$out/old_side.o" build-cpu/libkvattn.a \
  "$out/libbase.a" -lpthread -o "$out/ab"
echo "built $out/ab (base $base)"
