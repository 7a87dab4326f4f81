#!/usr/bin/env bash
# One device call for the latency of the decode-shaped kernel at small batch (issues 14, 19):
#   1. phase stamps of the kernel (a build with -DKVATTN_TC_DECODE_TRACE=ON: bench/NOTES.md) on
#      verify b1 and tensor-core decode b1 x TRACE_KV (default 1024 4096; the last two launches
#      of each row) with the CTAs' placement (SMs used, clusters that fit),
#   2. the decode rows on the automatic kernel choice and on the decode-shaped kernel
#      (KVATTN_DECODE_TENSOR_CORES=1; DEC_MODES picks), on the CUDA-graph buffers, JSON in $OUT,
#   3. the verify rows under each KNOBS entry (;-separated env assignments) and without,
#   4. NCU=1: ncu of the kernel at verify b1 (details and per-SASS-instruction stalls, CSV),
#   5. optionally (PEERS=1) bench/peers decode rows with KVATTN_DECODE_TENSOR_CORES=1 (carry
#      .whl/peers and the kvattn wheel as for bench/device_validate.sh).
# Carry .carry/bins.tar.xz holding carry/cur/{kvattn,COMMIT} and carry/trace/kvattn (stripped;
# bench/NOTES.md "Method"). A short table is printed last; logs in $OUT/logs.tgz.
set -u
OUT=${OUT:-/tmp/kvattn-latency}
L=$OUT/logs
mkdir -p "$L"
tar -xJf .carry/bins.tar.xz -C /tmp
K=/tmp/carry/cur/kvattn
KT=/tmp/carry/trace/kvattn
export KVATTN_GIT_COMMIT=${KVATTN_GIT_COMMIT:-$(cat /tmp/carry/cur/COMMIT 2>/dev/null || echo unknown)}
DEADLINE=${DEADLINE:-560}
run() {  # run NAME LIMIT COMMAND... (none past the deadline)
  local name=$1 limit=$2
  shift 2
  if [ $((SECONDS + limit)) -gt "$DEADLINE" ]; then echo "$name skipped: deadline" >> "$L/steps.txt"; return; fi
  local t=$SECONDS
  timeout "$limit" "$@" > "$L/$name.txt" 2>&1
  echo "$name rc $? $((SECONDS - t))s" >> "$L/steps.txt"
}
if [ -x "$KT" ]; then
  KVATTN_TC_DECODE_TRACE=1 run trace-verify 40 "$KT" bench --device cuda --rows 'verify b1 '
  for kv in ${TRACE_KV:-1024 4096}; do
    KVATTN_TC_DECODE_TRACE=1 KVATTN_DECODE_TENSOR_CORES=1 run "trace-decode$kv" 40 "$KT" bench \
      --device cuda --rows "decode b1 kv$kv d128 page1-"
  done
fi
day=$(date +%Y%m%d)
# DEC_MODES: auto (the automatic choice), tc (KVATTN_DECODE_TENSOR_CORES=1), core (=0);
# DEC_ROWS: a --rows pattern (default: every decode row)
dec_rows=(--workload decode)
[ -n "${DEC_ROWS:-}" ] && dec_rows=(--rows "$DEC_ROWS")
for mode in ${DEC_MODES:-auto tc}; do
  case $mode in auto) tc= ;; tc) tc=1 ;; core) tc=0 ;; *) continue ;; esac
  KVATTN_DECODE_TENSOR_CORES=$tc run "dec-$mode" 120 "$K" bench --device cuda "${dec_rows[@]}" \
    --json "$OUT/h200-decode-$mode-$day.json"
done
# DEC_KNOBS: ;-separated env assignments (space-separated within one), each a run of DEC_ROWS
IFS=';' read -r -a dec_knobs <<< "${DEC_KNOBS:-}"
for i in "${!dec_knobs[@]}"; do
  read -r -a assign <<< "${dec_knobs[$i]}"
  run "dec-knob$i" 120 env "${assign[@]}" "$K" bench --device cuda "${dec_rows[@]}"
done
run verify 40 "$K" bench --device cuda --workload verify
IFS=';' read -r -a knobs <<< "${KNOBS:-}"
for i in "${!knobs[@]}"; do
  read -r -a assign <<< "${knobs[$i]}"
  run "verify-knob$i" 40 env "${assign[@]}" "$K" bench --device cuda --workload verify
done
# NCU=1: the decode-shaped kernel at verify b1 under ncu (full set, one launch after warm-up):
# the details page and the per-SASS-instruction source page (stall reasons) as CSV in $OUT
if [ "${NCU:-0}" = 1 ]; then
  run ncu 150 ncu --clock-control none --set full -k regex:tc_decode_kernel --launch-skip 40 \
    --launch-count 1 -f -o "$OUT/ncu-verify-b1" "$K" bench --device cuda --rows 'verify b1 '
  ncu -i "$OUT/ncu-verify-b1.ncu-rep" --page details > "$OUT/ncu-verify-b1-details.txt" 2>&1
  ncu -i "$OUT/ncu-verify-b1.ncu-rep" --page source --csv --print-source sass \
    > "$OUT/ncu-verify-b1-sass.csv" 2>&1
fi
# A base binary (carry/base/kvattn, an older commit) for an A/B in the same call
KB=/tmp/carry/base/kvattn
if [ -x "$KB" ]; then
  run base-verify 40 "$KB" bench --device cuda --workload verify
  run base-dec 120 "$KB" bench --device cuda "${dec_rows[@]}"
fi
if [ "${PEERS:-0}" = 1 ] && [ $((DEADLINE - SECONDS)) -gt 150 ]; then
  run peersinstall 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/peers/*.whl .whl/py312/kvattn-0.1.0-cp312-cp312-linux_x86_64.whl
  left=$((DEADLINE - SECONDS - 30))
  KVATTN_DECODE_TENSOR_CORES=1 PYTHONPATH=/tmp/site \
    PATH="$(dirname "$(command -v python3)"):/usr/local/cuda/bin:$PATH" \
    CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" FLASHINFER_WORKSPACE_BASE=/tmp/fi-ws \
    FLASHINFER_CUDA_ARCH_LIST=9.0a TVM_FFI_CACHE_DIR=/tmp/tvm-ffi PYTHONUNBUFFERED=1 \
    run peers $((left + 20)) python3 bench/peers/run_peers.py --rows "${PEERS_ROWS:-^decode}" \
    --impls "${PEERS_IMPLS:-kvattn,flashinfer-decode,flashinfer-decode-tc}" --budget-s "$left" \
    --commit "$KVATTN_GIT_COMMIT" --out-dir "$OUT"
fi
{
  for f in "$L"/trace-*.txt; do
    [ -f "$f" ] || continue
    echo "== $(basename "$f" .txt)"
    grep -E "^(verify|decode) " "$f" | awk '{print "   row: " $0}' | cut -c1-120
    grep -E "tc_decode (trace|placement)|^  " "$f"
  done
  for f in "$L"/dec-*.txt "$L"/verify*.txt "$L"/base-*.txt; do
    [ -f "$f" ] || continue
    printf '%-14s %s\n' "$(basename "$f" .txt)" \
      "$(grep -E '^(decode|verify) ' "$f" | awk '{printf "b%s/kv%s:%s ", $2, $3, $9}')"
  done
  for i in "${!knobs[@]}"; do echo "knob$i = ${knobs[$i]}"; done
  for i in "${!dec_knobs[@]}"; do echo "dec-knob$i = ${dec_knobs[$i]}"; done
  grep -E "^\| decode" "$OUT"/peers-*.md 2>/dev/null | cut -d'|' -f2,3,7,8,9,10,11
  cat "$L/steps.txt"
} > "$OUT/latency.txt"
tar -C "$OUT" -czf "$OUT/logs.tgz" logs && rm -rf "$L"
cat "$OUT/latency.txt"
