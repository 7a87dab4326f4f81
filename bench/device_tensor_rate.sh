#!/usr/bin/env bash
# The tensor core's rate on the prefill products, kvattn against FlashInfer's FA3, at 1 x 16384
# hd128 causal (bench/NOTES.md, twenty-second and twenty-third sessions: the tensor pipe's busy
# time and the warps' instruction counts, kvattn against FA3). ncu at base clocks, one
# launch each after three; the metric names are taken from this ncu's own list (they differ
# between versions), so a missing one is skipped rather than failing the run.
#
#   bash bench/device_tensor_rate.sh KVATTN_CUDA_TESTS [SITE]
# SITE: the folder where the `.whl/peers` wheels were installed (bench/peers/README.md); FA3 is
# skipped without it. Prints one line per kernel; full logs under $OUT.
set -u
TESTS=${1:?kvattn_cuda_tests binary}; SITE=${2:-}
OUT=${OUT:-/tmp/kvattn-device}; mkdir -p "$OUT"
ncu --query-metrics --chip gh100 > "$OUT/ncu-metrics.txt" 2>&1
want=(sm__cycles_elapsed.max
      sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active
      sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
      sm__inst_executed_pipe_tensor_op_gmma.sum
      sm__inst_executed_pipe_tensor_op_hmma.sum
      l1tex__data_pipe_lsu_wavefronts_mem_shared.sum
      l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
      smsp__inst_executed.sum)
metrics=()
for m in "${want[@]}"; do
  base=${m%%.*}
  if grep -q "^$base\b" "$OUT/ncu-metrics.txt"; then metrics+=("$m"); fi
done
list=$(IFS=,; echo "${metrics[*]}")
echo "metrics: $list"
summarise() {
  awk -v name="$1" 'NF >= 3 && $1 ~ /__/ { v[$1] = $NF }
    END { printf "%-8s", name; for (k in v) printf "  %s %s", k, v[k]; printf "\n" }' "$2"
}
KVATTN_PREFILL_BENCH=1 KVATTN_PREFILL_BENCH_ONLY=0 timeout 120 ncu --clock-control base \
  -k regex:batch_prefill_sm90 --launch-skip 3 --launch-count 1 --metrics "$list" \
  "$TESTS" --gtest_filter=PrefillBench.Grid > "$OUT/rate-kvattn.log" 2>&1
summarise kvattn "$OUT/rate-kvattn.log"
if [[ -n "$SITE" ]]; then
  PYTHONPATH="$SITE" timeout 180 ncu --clock-control base -k regex:PrefillWithKVCacheKernel \
    --launch-skip 3 --launch-count 1 --metrics "$list" \
    python3 "$(dirname "$0")/peers/profile_fa3_prefill.py" > "$OUT/rate-fa3.log" 2>&1
  summarise fa3 "$OUT/rate-fa3.log"
fi
