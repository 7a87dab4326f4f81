#!/usr/bin/env bash
# Guards the Hopper prefill kernel's register allocation: compiles one instance file with
# `-Xptxas -v` and fails when an instance whose mangled name matches PATTERN spills more than
# MAX_BYTES bytes (spill stores). A change in the consumer's epilogue once made ptxas spill in the
# block loop (8 -> 116 bytes, +13% cycles at 1 x 16384; bench/NOTES.md, eighteenth session): this
# catches that on a machine without a GPU.
#
#   tools/check_kernel_spills.sh NVCC SOURCE_DIR "GENCODE FLAGS" FILE PATTERN MAX_BYTES
#   e.g. tools/check_kernel_spills.sh nvcc . "-gencode=arch=compute_90a,code=sm_90a" \
#          src/cuda/kernels/prefill_sm90_hd128.cu 'Li128ELi128ELi2E' 16
set -euo pipefail
nvcc=$1 root=$2 gencode=$3 file=$4 pattern=$5 max_bytes=$6
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# shellcheck disable=SC2086  # the gencode flags are a list
"$nvcc" -O3 -DNDEBUG -DKVATTN_SM90A_KERNELS=1 -DKVATTN_WITH_CUDA=1 "-DKVATTN_CUDA_HEAD_DIMS=64\\,128\\,192\\,256" \
  -I"$root/include" -I"$root/src" $gencode --expt-relaxed-constexpr -std=c++20 -Xptxas -v \
  -x cu -c "$root/$file" -o /dev/null > "$log" 2>&1 || { cat "$log"; exit 1; }
awk -v pattern="$pattern" -v max="$max_bytes" '
  /Compiling entry function/ { name = $0; sub(/.*function ./, "", name); sub(/. for .*/, "", name) }
  /bytes spill stores/ && name ~ pattern {
    for (i = 1; i <= NF; ++i) if ($(i + 1) == "bytes" && $(i + 2) == "spill" && $(i + 3) == "stores,") stores = $i
    printf "%s: %d bytes spill stores (at most %d)\n", name, stores, max
    seen++
    if (stores + 0 > max + 0) bad++
  }
  END {
    if (seen == 0) { print "no instance matches " pattern; exit 1 }
    exit bad > 0
  }' "$log"
