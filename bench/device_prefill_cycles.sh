#!/usr/bin/env bash
# Per-cycle A/B of the Hopper prefill kernel: ncu with the SM clock locked to base
# (`--clock-control base`) on one row of the kernel bench (PrefillBench.Grid), so that the number
# compared is the kernel's cycle count (sm__cycles_elapsed.max; ~0.1% run to run), not a time that
# moves with the power cap (~2%: bench/NOTES.md, seventeenth session). Prints one line per
# configuration and repeat: cycles, tensor pipe active, L2 hit rate.
#
#   bash bench/device_prefill_cycles.sh ROW REPEATS NAME=BINARY[:ENV=VALUE[:ENV=VALUE]] ...
#   e.g. bash bench/device_prefill_cycles.sh 0 2 head=.carry/bin/kvattn_cuda_tests \
#          s3=.carry/bin/kvattn_cuda_tests:KVATTN_SM90_STAGES=3 other=.carry/bin/other_tests
# ROW indexes PrefillBench.Grid's rows (0: prefill 1 x 16384 ragged hd128, 1: the same page 1,
# 2: 1 x 4096, 3: 1 x 1024, 4: 8 x 2048, 5: extend 8 x (4096 + 512) page 1, 6: hd64 1 x 4096,
# 7: hd256 1 x 4096; past the grid, KVATTN_PREFILL_BENCH_ONLY only: 8: hd64 1 x 16384, 9: hd256
# 1 x 16384). Each measurement takes ~5-10 s (one launch profiled after three).
set -u
ROW=${1:?row}; REPEATS=${2:?repeats}; shift 2
OUT=${OUT:-/tmp/kvattn-device}; mkdir -p "$OUT"
METRICS=sm__cycles_elapsed.max,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct
for ((r = 0; r < REPEATS; ++r)); do
  for config in "$@"; do
    name=${config%%=*}; rest=${config#*=}
    IFS=: read -r -a parts <<< "$rest"
    binary=${parts[0]}; envs=("${parts[@]:1}")
    log="$OUT/cycles-$name-$r.log"
    env "${envs[@]}" KVATTN_PREFILL_BENCH=1 KVATTN_PREFILL_BENCH_ONLY="$ROW" timeout 90 \
      ncu --clock-control base -k regex:batch_prefill_sm90 --launch-skip 3 --launch-count 1 \
      --metrics "$METRICS" "$binary" --gtest_filter='PrefillBench.Grid' > "$log" 2>&1
    awk -v name="$name" -v r="$r" '
      $1 == "sm__cycles_elapsed.max" { c = $NF }
      $1 ~ /^sm__pipe_tensor_op_hmma_cycles_active/ { t = $NF }
      $1 == "lts__t_sector_hit_rate.pct" { h = $NF }
      END { printf "%-12s #%d  cycles %14s  tensor %6s%%  L2 hit %6s%%\n", name, r, c, t, h }' "$log"
  done
done
