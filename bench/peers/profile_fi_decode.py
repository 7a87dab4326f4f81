#!/usr/bin/env python3
"""FlashInfer's decode (tensor-core wrapper by default) on the shared-prefix batch of the peers
grid, launched a few times for a profiler: the per-kernel comparison with kvattn's decode on
`decode b64 kv8448 shared8192 no-cascade-page{1,16}-shuffled` (issue 14, bench/NOTES.md).

The same shape as run_peers.py's row: 64 requests of 8448 keys whose first 8192 sit on one set
of pages shared by every request (the prompt), the rest on the request's own pages, every page
shuffled in a pool whose page 0 is never used; 32 q / 8 kv heads, head_dim 128, bf16, N(0, 1).

On the device, after installing the `.whl/peers` wheels into /tmp/site (bench/peers/README.md):

    PYTHONPATH=/tmp/site ncu -k regex:'Prefill|Decode|Merge' --launch-skip 6 --launch-count 2 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        python3 bench/peers/profile_fi_decode.py --page-size 16

and kvattn's kernel on the same row: `ncu -k regex:tc_decode ... kvattn bench --device cuda
--workload cascade --rows no-cascade-page16`.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_peers  # noqa: E402  (install_aot: the prebuilt modules)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--kv-len", type=int, default=8448)
    parser.add_argument("--shared", type=int, default=8192, help="the prompt's keys (whole pages)")
    parser.add_argument("--reps", type=int, default=5, help="launches before the timed twenty")
    parser.add_argument("--cuda-cores", action="store_true", help="the CUDA-core decode wrapper")
    parser.add_argument("--aot-dir", default=run_peers.DEFAULT_AOT_DIR)
    args = parser.parse_args()
    if os.path.isdir(args.aot_dir):
        print("prebuilt FlashInfer modules:", run_peers.install_aot(args.aot_dir))
    import flashinfer as fi

    b, ps, hq, hk, d = args.batch, args.page_size, 32, 8, 128
    if args.shared % ps or args.kv_len < args.shared:
        raise SystemExit("the prompt must be whole pages and at most kv_len")
    per_request = -(-args.kv_len // ps)
    shared_pages = args.shared // ps
    own_pages = per_request - shared_pages
    num_pages = 1 + shared_pages + b * own_pages
    gen = torch.Generator(device="cpu")
    gen.manual_seed(1234 ^ ps)
    order = torch.randperm(num_pages - 1, generator=gen) + 1
    pages = torch.cat([order[:shared_pages].expand(b, shared_pages),
                       order[shared_pages:].view(b, own_pages)], dim=1)
    torch.manual_seed(0)
    dev = dict(device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(num_pages, ps, hk, d, **dev)
    v_cache = torch.randn(num_pages, ps, hk, d, **dev)
    q = torch.randn(b, hq, d, **dev)
    i32 = dict(dtype=torch.int32, device="cuda")
    indptr = torch.arange(b + 1, **i32) * per_request
    indices = pages.reshape(-1).to(**i32)
    last_page_len = torch.full((b,), args.kv_len - (per_request - 1) * ps, **i32)
    workspace = torch.zeros(512 << 20, dtype=torch.uint8, device="cuda")
    tc = not args.cuda_cores
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tc,
                                                    backend="fa2" if tc else "auto")
    wrapper.plan(indptr, indices, last_page_len, hq, hk, d, ps, q_data_type=torch.bfloat16,
                 kv_data_type=torch.bfloat16, sm_scale=d ** -0.5)
    out = torch.empty_like(q)
    for _ in range(args.reps):
        wrapper.run(q, (k_cache, v_cache), out=out)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        wrapper.run(q, (k_cache, v_cache), out=out)
    stop.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(stop) / 20 * 1e3
    kind = "decode" if args.cuda_cores else "decode-tc"
    print(f"flashinfer {kind} b{b} kv{args.kv_len} shared{args.shared} page {ps}: {us:.1f} us a "
          f"call (back to back, the pool {k_cache.numel() * 4 / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
