#!/usr/bin/env bash
# A/B of several builds of kvattn on the decode-shaped rows, in one device call (the tc_decode
# v8/v9 measurements of bench/NOTES.md were taken this way). Build each variant here, strip it,
# and carry them in one xz tarball (15-17 MB a binary; the carry limit is 64 MiB):
#   mkdir -p /tmp/ab/carry/<name> && cp build/kvattn /tmp/ab/carry/<name>/ && strip ...
#   (cd /tmp/ab && tar -cf - carry | xz -T2 -6 > .carry/bins.tar.xz)
# device: bash bench/device_ab.sh "v9 v8 n2"       (carry: [".carry"])
# Each variant runs WORKLOADS (default: verify draft) REPEAT times; KNOBS (a ;-separated list of
# env assignments) run the first variant's verify rows once each, e.g.
#   KNOBS="KVATTN_TC_DECODE_MERGE=grid;KVATTN_TC_DECODE_MAX_CLUSTER=8"
# NCU=1 adds the kernel time of the first variant's tc_decode at verify b1 (ncu, 3 launches).
# A per-step time guard (DEADLINE, default 480 s) keeps the log tarball coming back; the table
# of rows (us) is printed last and written to $OUT/ab.txt.
set -u
VARIANTS=${1:?variant names (folders under carry/)}
OUT=${OUT:-/tmp/kvattn-ab}
L=$OUT/ab-logs
mkdir -p "$L"
tar -xJf .carry/bins.tar.xz -C /tmp
DEADLINE=${DEADLINE:-480}
run() {  # run NAME COMMAND... (30 s at most, none past the deadline)
  local name=$1
  shift
  if [ $((SECONDS + 30)) -gt "$DEADLINE" ]; then echo "$name skipped: deadline" >> "$L/steps.txt"; return; fi
  local t=$SECONDS
  timeout 30 "$@" > "$L/$name.txt" 2>&1
  echo "$name rc $? $((SECONDS - t))s" >> "$L/steps.txt"
}
first=${VARIANTS%% *}
for r in $(seq 1 "${REPEAT:-1}"); do
  for v in $VARIANTS; do
    for w in ${WORKLOADS:-verify draft}; do
      run "$v-$w-$r" "/tmp/carry/$v/kvattn" bench --device cuda --workload "$w"
    done
  done
done
IFS=';' read -r -a knobs <<< "${KNOBS:-}"
for i in "${!knobs[@]}"; do
  run "knob$i" env "${knobs[$i]}" "/tmp/carry/$first/kvattn" bench --device cuda --workload verify
done
if [ "${NCU:-0}" = 1 ]; then
  run ncu ncu --clock-control none --metrics gpu__time_duration.sum,smsp__inst_executed.sum \
    -k regex:tc_decode --launch-skip 20 --launch-count 3 "/tmp/carry/$first/kvattn" bench \
    --device cuda --workload verify
fi
{
  for f in "$L"/*.txt; do
    case $(basename "$f") in steps.txt|ncu.txt) continue ;; esac
    printf '%-24s %s\n' "$(basename "$f" .txt)" \
      "$(grep -E '^(verify|draft)' "$f" | awk '{printf "%s ", $9}')"
  done
  for i in "${!knobs[@]}"; do echo "knob$i = ${knobs[$i]}"; done
  grep -hE "gpu__time|inst_executed" "$L/ncu.txt" 2>/dev/null
  cat "$L/steps.txt"
} > "$OUT/ab.txt"
tar -C "$OUT" -czf "$OUT/ab-logs.tgz" ab-logs && rm -rf "$L"
cat "$OUT/ab.txt"
