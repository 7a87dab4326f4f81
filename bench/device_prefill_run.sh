#!/usr/bin/env bash
# One device call for the prefill kernels, in order of what must hold first: the wgmma layout
# probe, the prefill kernel tests (the default family: Hopper on an H200), then (only when those
# pass) the A/B timing of both families on the SPEC §6 prefill grid, the whole CUDA suite and
# `kvattn check`. Build here and carry the binaries:
#   mkdir -p .carry && cp build/kvattn build/kvattn_cuda_tests .carry/
#   device run: bash bench/device_prefill_run.sh .carry [steps]     (carry: [".carry"])
# steps: a comma list of probe,tests,tests_variants,bench,bench_mma,variants,suite,check,grid,
# sanitize,ncu
# (default: probe,tests,bench,suite,check,sanitize).
# Logs and JSON go to $OUT; a summary is printed last.
set -u
CARRY=${1:-.carry}
STEPS=${2:-probe,tests,bench,suite,check,sanitize}
OUT=${OUT:-/tmp/kvattn-device}
mkdir -p "$OUT"
# A binary run beside the device copy's stale .git must be told its commit (results JSON).
[ -f "$CARRY/COMMIT" ] && export KVATTN_GIT_COMMIT=${KVATTN_GIT_COMMIT:-$(head -1 "$CARRY/COMMIT")}
BIN="$CARRY/kvattn_cuda_tests"
summary=()
want() { [[ ",$STEPS," == *",$1,"* ]]; }
step() {  # step NAME SECONDS COMMAND...: runs, logs to $OUT/NAME.log (or appends to $OUT/$LOG
  local name=$1 limit=$2  # when LOG is set: at most 8 files come back), records rc and time
  shift 2
  local t0=$SECONDS
  local log="$OUT/${LOG:-$name.log}"
  [ -n "${LOG:-}" ] && echo "#### $name" >> "$log"
  timeout "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  summary+=("$(printf '%-16s rc %-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
  return $rc
}

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > "$OUT/gpu.txt" 2>&1
ok=1
if want probe; then step probe 60 "$BIN" --gtest_filter='Sm90Wgmma.*' || ok=0; fi
if want tests; then
  step tests 240 "$BIN" --gtest_filter='PrefillKernel*' || ok=0
fi
if want tests_variants; then  # the kernel tests under each variant (same bars)
  for v in ${VARIANTS:-}; do
    export "$v"
    LOG=tests_variants.log step "tests $v" 240 "$BIN" --gtest_filter='PrefillKernel*' || ok=0
    unset "${v%%=*}"
  done
fi
if [ $ok = 1 ] && want bench; then
  LOG=bench.log KVATTN_PREFILL_BENCH=1 step bench_sm90 150 "$BIN" --gtest_filter='PrefillBench.*'
fi
if [ $ok = 1 ] && want bench_mma; then
  LOG=bench.log KVATTN_PREFILL_KERNEL=mma KVATTN_PREFILL_BENCH=1 step bench_mma 150 "$BIN" \
    --gtest_filter='PrefillBench.*'
fi
if [ $ok = 1 ] && want variants; then  # launch-option A/B of the Hopper kernel
  for v in ${VARIANTS:-KVATTN_SM90_PINGPONG=0 KVATTN_SM90_CTAS=1000000}; do
    export "$v"
    LOG=bench.log KVATTN_PREFILL_BENCH=1 step "bench $v" 150 "$BIN" --gtest_filter='PrefillBench.*'
    unset "${v%%=*}"
  done
fi
if [ $ok = 1 ] && want suite; then step suite 240 "$BIN" --gtest_brief=1; fi
if [ $ok = 1 ] && want check; then LOG=checks.log step check 120 "$CARRY/kvattn" check --device cuda; fi
if [ $ok = 1 ] && want grid; then  # the SPEC §6 prefill / extend rows through the backend
  for w in prefill extend; do
    LOG=bench.log step "grid $w" 150 "$CARRY/kvattn" bench --device cuda --workload $w \
      --json "$OUT/h200-$w-$(date +%Y%m%d).json"
  done
fi
if [ $ok = 1 ] && want sanitize; then
  LOG=checks.log step memcheck 180 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN" \
    --gtest_filter='PrefillKernel.CausalPagedPage1Shuffled:PrefillKernel.RaggedWithLse:PrefillKernel.Fp8Kv:PrefillKernel.SplitKv*:PrefillKernel.KvLenZeroAndOne:PrefillKernel.HeadDim192V128'
  LOG=checks.log step racecheck 180 compute-sanitizer --tool racecheck --error-exitcode 9 "$BIN" \
    --gtest_filter='PrefillKernel.CausalPagedPage1Shuffled:PrefillKernel.RaggedWithLse:PrefillKernel.Fp8Kv'
fi
if want ncu; then
  # One row (prefill 1 x 4096 hd128 ragged, index 2) under Nsight Compute, every section.
  KVATTN_PREFILL_BENCH=1 KVATTN_PREFILL_BENCH_ONLY=${NCU_ROW:-2} step ncu 300 ncu --clock-control none \
    --kernel-name regex:batch_prefill --launch-count 1 --set full --import-source yes \
    --print-details all -o "$OUT/prof" "$BIN" --gtest_filter='PrefillBench.*'
  # Per-SASS-instruction samples (stall reasons, executed instructions) for offline reading.
  ncu --import "$OUT/prof.ncu-rep" --page source --csv --print-source sass > "$OUT/source.csv" \
    2>> "$OUT/ncu.log"
  # The details page (throughputs, pipe utilisation, stall summary, occupancy) as text.
  ncu --import "$OUT/prof.ncu-rep" --page details --print-details all >> "$OUT/ncu.log" 2>&1
  gzip -f "$OUT/source.csv"
  rm -f "$OUT/prof.ncu-rep"
fi

echo "== GPU"; cat "$OUT/gpu.txt"
for f in probe tests tests_variants suite; do
  [ -f "$OUT/$f.log" ] || continue
  echo "== $f"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|expected|rel_l2|threw|Timeout|error" "$OUT/$f.log" | head -40
done
[ -f "$OUT/checks.log" ] && { echo "== check / sanitizers"; grep -E "^####|FAIL|passed, |ERROR SUMMARY|RACECHECK SUMMARY|Invalid|hazard" "$OUT/checks.log" | head -30; }
[ -f "$OUT/bench.log" ] && { echo "== bench"; grep -E "^####|^prefill|^extend|GEMM|FAILED|ceiling" "$OUT/bench.log"; }
[ -f "$OUT/ncu.log" ] && { echo "== ncu"; grep -E "Duration|Compute \(SM\) Throughput|Issue Slots|Executed Ipc A|Warp Cycles Per Issued|highest-utilized|Tensor|L2 Hit|L1/TEX Hit|Mem Pipes|Bank|Registers" "$OUT/ncu.log" | head -30; }
echo "== steps"; printf '%s\n' "${summary[@]}"
