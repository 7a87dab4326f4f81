#!/usr/bin/env python3
"""Summarises an ncu source page (`ncu -i R.ncu-rep --page source --print-source sass --csv`):
warp-stall samples by code region, the loops (backward branches), and the instructions with the
most samples with their stall reasons, for one kernel. Used to compare kvattn's Hopper prefill
with FA3 per instruction (bench/NOTES.md, seventeenth session).

    python3 bench/ncu_source_summary.py kv_source.csv              # regions and loops
    python3 bench/ncu_source_summary.py kv_source.csv 0x7d30 0xe940 # one address range

Addresses are byte offsets from the kernel's first instruction (as in `cuobjdump -sass`). Samples
without a listed reason (the CSV has no "gmma" column) count in the total only.
"""
import collections
import csv
import re
import sys


def load(path):
    rows = list(csv.reader(open(path, newline="")))
    header = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    hdr, data = rows[header], rows[header + 1:]
    col = {name: hdr.index(name) for name in ("Address", "Source")}
    samples = hdr.index("Warp Stall Sampling (All Samples)")
    stalls = [(i, h[len("stall_"):]) for i, h in enumerate(hdr)
              if h.startswith("stall_") and "Not Issued" not in h]
    base = int(data[0][col["Address"]], 16)
    out = []
    for r in data:
        if len(r) <= samples or not r[col["Address"]].startswith("0x"):
            continue
        source = r[col["Source"]].strip()
        # A predicated branch's target as an offset (the CSV prints absolute addresses); the
        # out-of-line retry stubs of barrier waits jump back unpredicated and get none.
        branch = re.search(r"^@!?U?P\d\s+BRA (0x[0-9a-f]+)", source)
        out.append({
            "offset": int(r[col["Address"]], 16) - base,
            "source": source,
            "samples": int(r[samples] or 0),
            "stalls": {name: int(r[i]) for i, name in stalls if r[i] not in ("", "0")},
            "branch_to": int(branch.group(1), 16) - base if branch else None,
        })
    return out


def summary(instrs, lo, hi, total, top=25):
    sel = [i for i in instrs if lo <= i["offset"] <= hi]
    s = sum(i["samples"] for i in sel)
    print(f"range {lo:#x}-{hi:#x}: {s} samples ({s / max(total, 1):.1%}), {len(sel)} instructions")
    reasons = collections.Counter()
    for i in sel:
        reasons.update(i["stalls"])
    print("  reasons: " + ", ".join(f"{k} {v / max(s, 1):.1%}" for k, v in reasons.most_common(10)))
    for i in sorted(sel, key=lambda i: -i["samples"])[:top]:
        listed = sum(i["stalls"].values())
        why = dict(sorted(i["stalls"].items(), key=lambda kv: -kv[1])[:3])
        if i["samples"] - listed > i["samples"] // 3:
            why["unlisted (gmma)"] = i["samples"] - listed
        print(f"  {i['offset']:7x} {i['samples']:7d}  {i['source'][:58]:58s} {why}")


def main():
    instrs = load(sys.argv[1])
    total = sum(i["samples"] for i in instrs)
    print(f"{len(instrs)} instructions, {total} samples")
    if len(sys.argv) >= 4:
        summary(instrs, int(sys.argv[2], 16), int(sys.argv[3], 16), total)
        return
    buckets = collections.Counter()
    for i in instrs:
        buckets[i["offset"] // 0x800] += i["samples"]
    print("samples by 2 KiB of code (>= 0.5%):")
    for b in sorted(buckets):
        if buckets[b] >= total * 0.005:
            print(f"  {b * 0x800:7x} {buckets[b]:8d} {buckets[b] / total:6.1%}")
    print("loops (predicated backward branches over more than 64 instructions):")
    for b in instrs:
        target, at = b["branch_to"], b["offset"]
        if target is not None and 0 <= target < at and at - target > 64 * 16:
            inside = [i for i in instrs if target <= i["offset"] <= at]
            s = sum(i["samples"] for i in inside)
            print(f"  {target:#7x} <- {at:#7x}: {len(inside)} instructions, "
                  f"{s / max(total, 1):.1%} of samples")


if __name__ == "__main__":
    main()
