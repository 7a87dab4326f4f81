#!/usr/bin/env python3
"""FlashInfer's FA3 (or FA2) ragged causal prefill on one request, launched a few times for a
profiler: the per-cycle comparison of kvattn's Hopper prefill with FA3 (bench/NOTES.md,
seventeenth session). Same shape as the kernel bench's first row (PrefillBench.Grid, row 0):
32 q / 8 kv heads, head_dim 128 (--head-dim: 64 or 256 for those rows' shape), bf16, random
N(0, 1) inputs.

On the device, after installing the `.whl/peers` wheels into /tmp/site (bench/peers/README.md):

    PYTHONPATH=/tmp/site ncu --clock-control base -k regex:PrefillWithKVCacheKernel \
        --launch-skip 3 --launch-count 1 --section SourceCounters --section WarpStateStats \
        -o /tmp/fa python3 bench/peers/profile_fa3_prefill.py
    PYTHONPATH=/tmp/site KVATTN_PREFILL_BENCH=1 KVATTN_PREFILL_BENCH_ONLY=0 ncu \
        --clock-control base -k regex:batch_prefill_sm90 --launch-skip 3 --launch-count 1 \
        --section SourceCounters --section WarpStateStats -o /tmp/kv \
        ./kvattn_cuda_tests --gtest_filter=PrefillBench.Grid
    ncu -i /tmp/fa.ncu-rep --page source --print-source sass --csv > fa_source.csv

then `python3 bench/ncu_source_summary.py fa_source.csv` here. `.whl/peers/aot` (the prebuilt
fa3-bf16 module) is copied into FlashInfer first, so nothing is compiled on the device.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_peers  # noqa: E402  (install_aot: the prebuilt modules)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--len", type=int, default=16384, help="tokens of the one request")
    parser.add_argument("--reps", type=int, default=5, help="launches before the timed ten")
    parser.add_argument("--backend", default="fa3", choices=("fa3", "fa2"))
    parser.add_argument("--head-dim", type=int, default=128, help="head_dim of q, k and v")
    parser.add_argument("--aot-dir", default=run_peers.DEFAULT_AOT_DIR)
    parser.add_argument("--extend", type=int, nargs=2, metavar=("BATCH", "PREFIX"),
                        help="FA3's paged prefill instead: BATCH requests of PREFIX cached and "
                        "--len new tokens each, page 1 with shuffled slots (the kernel bench's "
                        "extend row: --len 512 --extend 8 4096)")
    args = parser.parse_args()
    if os.path.isdir(args.aot_dir):
        print("prebuilt FlashInfer modules:", run_peers.install_aot(args.aot_dir))
    import flashinfer as fi

    n, hq, hk, d = args.len, 32, 8, args.head_dim
    torch.manual_seed(0)
    q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(n, hk, d, device="cuda", dtype=torch.bfloat16)
    workspace = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    i32 = dict(dtype=torch.int32, device="cuda")
    if args.extend:
        batch, prefix = args.extend
        kv_len = prefix + n
        q = torch.randn(batch * n, hq, d, device="cuda", dtype=torch.bfloat16)
        pools = tuple(torch.randn(batch * kv_len, 1, hk, d, device="cuda", dtype=torch.bfloat16)
                      for _ in range(2))
        slots = torch.randperm(batch * kv_len, device="cuda").to(torch.int32)
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=args.backend)
        wrapper.plan(torch.arange(batch + 1, **i32) * n, torch.arange(batch + 1, **i32) * kv_len,
                     slots, torch.ones(batch, **i32), hq, hk, d, 1, causal=True,
                     sm_scale=d ** -0.5, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        what = f"paged extend {batch} x ({prefix} + {n})"

        def run():
            return wrapper.run(q, pools)
    else:
        indptr = torch.tensor([0, n], **i32)
        wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend=args.backend)
        wrapper.plan(indptr, indptr, hq, hk, d, causal=True, sm_scale=d ** -0.5,
                     q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        what = f"ragged causal 1 x {n}"

        def run():
            return wrapper.run(q, k, v)
    for _ in range(args.reps):
        run()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        run()
    stop.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(stop) / 10 * 1e3
    print(f"{args.backend} {what} hd{d}: {us:.1f} us a call")


if __name__ == "__main__":
    main()
