#!/usr/bin/env bash
# One device call that validates the CUDA backend end to end and times the decode-shaped rows:
#   1. the kernel tests of the decode-shaped kernel and the verify/draft graph tests,
#   2. the decode-shaped timing table (tc_decode vs the prefill family, same run) and
#      `kvattn bench --workload verify|draft` (results JSON in $OUT),
#   3. the whole CUDA test binary,
#   4. tests/cuda/run_device_checks.sh (bad input, refused steps, memcheck, racecheck, soak),
#   5. `kvattn check --device cuda` and compute-sanitizer memcheck over it,
#   6. Python on the GPU: the torch tests (bad index / huge first) and the Hugging Face Llama
#      example (python/examples/hf_llama_paged.py --device cuda).
# Build here and carry the binaries and the wheel:
#   mkdir -p .carry && cp build/kvattn build/kvattn_cuda_tests .carry/ && git rev-parse HEAD >
#   .carry/COMMIT; wheel in .whl/py312/ (pip wheel ./python with Python 3.12)
#   device run: bash bench/device_validate.sh .carry    (carry: [".carry", ".whl/py312"])
# STEPS=a,b,... picks steps (decodeab (decode rows: auto vs KVATTN_DECODE_TENSOR_CORES=1), diag (tc_decode DIAG matrix, decode split A/B), prof (ncu per-kernel time of PROF_WORKLOADS),tc,tckernel (KVATTN_TC_DECODE_MERGE=kernel),tcbench,bench,all,checks,sanitize,check,python,llama,peers;
# TC_FILTER / SAN_FILTER / RACE_FILTER override the tc / memcheck / racecheck test filters; DIAG_MERGES (cluster grid) and
# DIAG_LEVELS (0 1 2 3 4) pick the diag matrix; CHECKMEM=0 skips memcheck over `kvattn check`
# (150 s). The whole CUDA test binary (`all`) takes over 200 s on the H200 (CudaDecode's
# targeted cases alone ~70 s: their float64 references); give it ALL_FILTER or its own call.
# Binaries over the 64 MiB carry: strip them and carry an xz tarball (bench/NOTES.md). peers: FlashInfer
# side by side on PEERS_ROWS, default ^verify, PEERS_IMPLS a comma list, carry .whl/peers too); logs go to $OUT/logs.tgz and a
# summary is printed last (also $OUT/summary.txt).
set -u
CARRY=${1:-.carry}
OUT=${OUT:-/tmp/kvattn-device}
LOGS=$OUT/logs
mkdir -p "$LOGS"
STEPS=${STEPS:-tc,tcbench,bench,all,checks,check,python,llama}
summary=()
want() { [[ ",$STEPS," == *",$1,"* ]]; }
DEADLINE=${DEADLINE:-570}  # seconds: no step runs past it (the summary still gets written)
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - SECONDS - 10))
  if [ "$left" -lt 15 ]; then
    summary+=("$(printf '%-10s skipped: deadline' "$name")")
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-10s rc %-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
  return $rc
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > "$LOGS/gpu.txt" 2>&1
T=$CARRY/kvattn_cuda_tests

want tc && step tc 120 "$T" --gtest_filter="${TC_FILTER:-TcDecodeKernel*:PrefillKernel.*:CudaGraphs*:CudaScenarios.*:*CudaDeterministic*:CudaCascade.*}"
# the decode-shaped kernel with its split merge inside the kernel (the A/B knob)
want tckernel && KVATTN_TC_DECODE_MERGE=kernel step tckernel 60 "$T" --gtest_filter='TcDecodeKernel*'
want tcbench && KVATTN_PREFILL_BENCH=1 step tcbench 90 "$T" \
  --gtest_filter='PrefillBench.DecodeShaped'
if want bench; then
  export KVATTN_GIT_COMMIT=${KVATTN_GIT_COMMIT:-$(cat "$CARRY/COMMIT" 2>/dev/null || echo unknown)}
  for w in verify draft cascade; do
    step "bench-$w" 90 "$CARRY/kvattn" bench --device cuda --workload "$w" \
      --json "$OUT/h200-$w-$(date +%Y%m%d).json"
  done
fi
# per-kernel GPU time of one workload's calls (ncu, one duration metric, clocks left alone)
if want prof; then
  for w in ${PROF_WORKLOADS:-cascade verify}; do
    step "prof-$w" 150 ncu --clock-control none --metrics gpu__time_duration.sum \
      --launch-count "${PROF_LAUNCHES:-600}" --print-summary per-kernel \
      "$CARRY/kvattn" bench --device cuda --workload "$w"
  done
fi
# time attribution of the decode-shaped kernel (KVATTN_TC_DECODE_DIAG, garbage output: the rows
# report FAIL on their check, the time is what counts) under both split merges, and the plain
# decode of a shared prompt with and without its split (L2 reuse; bench/NOTES.md v6)
if want diag; then
  for m in ${DIAG_MERGES:-cluster grid}; do
    for d in ${DIAG_LEVELS:-0 1 2 3 4}; do
      KVATTN_TC_DECODE_MERGE=$m KVATTN_TC_DECODE_DIAG=$d step "diag-$m-$d" 40 "$CARRY/kvattn" \
        bench --device cuda --workload verify
    done
  done
  step nosplit-default 60 "$CARRY/kvattn" bench --device cuda --workload cascade
  KVATTN_DECODE_MIN_CHUNK=16384 step nosplit-16384 60 "$CARRY/kvattn" bench --device cuda \
    --workload cascade
fi
want all && step all 200 "$T" --gtest_brief=1 --gtest_filter="${ALL_FILTER:-*}"
# (checks: its CUDA-graph tests, memcheck over the bad-input tests and the soak take several
# minutes together; run it in a call of its own or with few other steps.)
want checks && SOAK_STEPS=${SOAK_STEPS:-10000} OUT=$LOGS/checks step checks 560 \
  bash tests/cuda/run_device_checks.sh "$T"
if want sanitize; then  # the decode-shaped kernel under memcheck and racecheck (small cases)
  step memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$T" \
    --gtest_filter="${SAN_FILTER:-TcDecodeKernel.DecodeGroupsAndShortKv:TcDecodeKernel.Fp8KvAndFp32Output}"
  step racecheck 120 compute-sanitizer --tool racecheck --error-exitcode 9 "$T" \
    --gtest_filter="${RACE_FILTER:-TcDecodeKernel.DecodeGroupsAndShortKv}"
fi
want check && step check 60 "$CARRY/kvattn" check --device cuda
want check && [ "${CHECKMEM:-1}" = 1 ] && step checkmem 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
  "$CARRY/kvattn" check --device cuda
if want python; then
  step pyinstall 60 python3 -m pip install -q --no-index --no-deps --target /tmp/site \
    .whl/py312/kvattn-0.1.0-cp312-cp312-linux_x86_64.whl
  PYTHONPATH=/tmp/site step pybad 120 python3 -m pytest -q -p no:cacheprovider \
    python/tests/test_gpu_torch.py -k "bad_index or huge"
  PYTHONPATH=/tmp/site step pytorch 200 python3 -m pytest -q -p no:cacheprovider \
    python/tests/test_gpu_torch.py
  # host syncs and device-to-host copies of a step, counted by CUPTI (issue 15)
  PYTHONPATH=/tmp/site step pysync 120 python3 -m pytest -q -s -p no:cacheprovider \
    python/tests/test_gpu_sync_counts.py
fi
if want llama; then
  PYTHONPATH=/tmp/site step llama 150 python3 python/examples/hf_llama_paged.py --device cuda
fi
if want peers; then  # last: FlashInfer side by side on PEERS_ROWS, in the time left
  left=$((DEADLINE - SECONDS - 40))
  [ -n "${PEERS_BUDGET:-}" ] && [ "$PEERS_BUDGET" -lt "$left" ] && left=$PEERS_BUDGET
  if [ "$left" -gt 120 ]; then
    step peersinstall 60 python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target /tmp/site .whl/peers/*.whl \
      .whl/py312/kvattn-0.1.0-cp312-cp312-linux_x86_64.whl
    left=$((left - ${PEERS_INSTALL_S:-20}))
    PYTHONPATH=/tmp/site PATH="$(dirname "$(command -v python3)"):/usr/local/cuda/bin:$PATH" \
      CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" FLASHINFER_WORKSPACE_BASE=/tmp/fi-ws \
      FLASHINFER_CUDA_ARCH_LIST=9.0a TVM_FFI_CACHE_DIR=/tmp/tvm-ffi PYTHONUNBUFFERED=1 \
      step peers $((left + 30)) python3 bench/peers/run_peers.py --rows "${PEERS_ROWS:-^verify}" ${PEERS_IMPLS:+--impls "$PEERS_IMPLS"} \
      --budget-s "$left" --commit "$(cat "$CARRY/COMMIT" 2>/dev/null)" --out-dir "$OUT"
  else
    summary+=("peers      skipped: $left s left")
  fi
fi
# decode rows on the automatic kernel choice and with every decode on the decode-shaped kernel
# (KVATTN_DECODE_TENSOR_CORES=1; issue 14), after the peers step (give that PEERS_BUDGET)
if want decodeab; then
  export KVATTN_GIT_COMMIT=${KVATTN_GIT_COMMIT:-$(cat "$CARRY/COMMIT" 2>/dev/null || echo unknown)}
  for w in ${DECODEAB_WORKLOADS:-decode cascade}; do
    step "dec-auto-$w" 150 "$CARRY/kvattn" bench --device cuda --workload "$w" \
      --json "$OUT/h200-$w-$(date +%Y%m%d).json"
    KVATTN_DECODE_TENSOR_CORES=1 step "dec-tc-$w" 150 "$CARRY/kvattn" bench --device cuda \
      --workload "$w" --json "$OUT/h200-$w-tc-$(date +%Y%m%d).json"
  done
fi

{
  echo "== GPU"; cat "$LOGS/gpu.txt"
  echo "== tc kernel + verify/draft graph + cascade tests"
  grep -E "^\[  (PASSED|FAILED) |FAILED  |Failure|  tc |rel_l2" "$LOGS/tc.log" 2>/dev/null | head -40
  echo "== decode-shaped timing"; grep -vE "^\[|^Note|^$" "$LOGS/tcbench.log" 2>/dev/null | tail -16
  echo "== kvattn bench (verify, draft, cascade)"
  grep -hE "^(verify|draft|decode)|ceiling" "$LOGS/bench-verify.log" "$LOGS/bench-draft.log" \
    "$LOGS/bench-cascade.log" 2>/dev/null
  for f in "$LOGS"/dec-*.log; do [ -f "$f" ] && { echo "-- $(basename "$f" .log)"; \
    grep -E '^decode' "$f" | awk '{printf "b%s/kv%s/%s:%s ", $2, $3, $8, $9} END {print ""}'; }; done
  echo "== DIAG (verify rows: batch/kv: us)"
  for f in "$LOGS"/diag-*.log; do [ -f "$f" ] && printf '%-22s %s\n' "$(basename "$f" .log)" \
    "$(grep -E '^verify' "$f" | awk '{printf "b%s/kv%s:%s ", $2, $3, $9}')"; done
  for f in "$LOGS"/nosplit-*.log; do [ -f "$f" ] && { echo "-- $(basename "$f" .log)"; \
    grep -E '^decode' "$f"; }; done
  echo "== per-kernel GPU time (ncu)"
  for f in "$LOGS"/prof-*.log; do [ -f "$f" ] && { echo "-- $f"; grep -E "^  [^ ].*\\(|gpu__time_duration" "$f" | cut -c1-160 | head -40; }; done
  echo "== all CUDA tests"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED  " "$LOGS/all.log" 2>/dev/null | head -30
  echo "== device checks"; tail -40 "$LOGS/checks.log" 2>/dev/null
  echo "== sanitizers"; grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$LOGS/memcheck.log" \
    "$LOGS/racecheck.log" 2>/dev/null
  echo "== check"; grep -E "FAIL|passed|not supported" "$LOGS/check.log" 2>/dev/null | tail -5
  grep -E "ERROR SUMMARY" "$LOGS/checkmem.log" 2>/dev/null
  echo "== python"; tail -3 "$LOGS/pybad.log" 2>/dev/null; tail -3 "$LOGS/pytorch.log" 2>/dev/null
  grep -hE "kvattn-gpu-test|passed|failed" "$LOGS/pysync.log" 2>/dev/null | tail -6
  echo "== llama example"; tail -8 "$LOGS/llama.log" 2>/dev/null
  echo "== peers"; tail -30 "$OUT"/peers-*.md 2>/dev/null
  echo "== steps"; printf '%s\n' "${summary[@]}"
} > "$OUT/summary.txt"
tar -C "$OUT" -czf "$OUT/logs.tgz" logs && rm -rf "$LOGS"
cat "$OUT/summary.txt"
