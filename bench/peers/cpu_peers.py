"""kvattn's CPU backend side by side with PyTorch's CPU SDPA on the CPU rows of issue 22, same
threads, same inputs: kvattn through its Python API over a paged pool with shuffled page-1 slots,
SDPA on a contiguous copy of the same K/V (no paging, no gather: it favours SDPA).

Rows (32 q / 8 kv heads, head_dim 128, bf16): decode b16 and b64 x 4096; prefill 1 x 1024 and
1 x 4096 causal (EXTEND without a prefix); decode b64 whose requests share an 8192-token prefix
(256 own tokens each: kvattn's cascade path, KVATTN_CASCADE=0 for the plain one). Each row: the median of timed calls after a warm-up,
the max relative difference between the two outputs, the rate (decode GB/s of K/V, prefill
GFLOP/s of the causal half), and SDPA time / kvattn time (> 1: kvattn faster).

    python3 bench/peers/cpu_peers.py [--threads N] [--json FILE] [--rows REGEX]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import time

import torch

import kvattn

Q_HEADS, KV_HEADS, DIM = 32, 8, 128
DTYPE = torch.bfloat16


def timed(fn, reps, min_seconds=1.0):
    fn()  # warm-up
    times = []
    start = time.perf_counter()
    while len(times) < reps or (time.perf_counter() - start < min_seconds and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


DETERMINISTIC = False  # --deterministic: kvattn's batch-invariant mode


def backend_over(k_pool, v_pool, table, threads):
    """kvattn's CPU backend over the pools and the req_to_token table (wrapped, not copied)."""
    cache = kvattn.KvCache.wrap(kvattn.KvCacheConfig(num_slots=k_pool.shape[0],
                                                     num_kv_heads=KV_HEADS, head_dim=DIM,
                                                     page_size=1, dtype=DTYPE, device="cpu"),
                                [k_pool], [v_pool])
    pool = kvattn.ReqToTokenPool.wrap(table)
    backend = kvattn.make_backend("cpu", kvattn.BackendConfig(
        kv_cache=cache, req_to_token_pool=pool, num_q_heads=Q_HEADS, num_kv_heads=KV_HEADS,
        head_dim=DIM, q_dtype=DTYPE, num_threads=threads, deterministic=DETERMINISTIC))
    return cache, pool, backend


def world(batch, kv_len, threads, seed):
    """A KV pool with shuffled page-1 slots holding batch x kv_len tokens, a backend over it, and
    each request's K/V in token order (for the contiguous SDPA copy)."""
    g = torch.Generator().manual_seed(seed)
    slots = batch * kv_len + 1
    k_pool = torch.randn(slots, KV_HEADS, DIM, generator=g).to(DTYPE)
    v_pool = torch.randn(slots, KV_HEADS, DIM, generator=g).to(DTYPE)
    order = torch.randperm(slots - 1, generator=g).to(torch.int32) + 1  # slot 0 reserved
    table = order.view(batch, kv_len).contiguous()
    cache, pool, backend = backend_over(k_pool, v_pool, table, threads)
    k_seq = k_pool[table.long()]  # [batch, kv_len, heads, dim]
    v_seq = v_pool[table.long()]
    return cache, pool, backend, table, k_seq, v_seq


def time_decode(backend, cache, pool, table, k_seq, v_seq):
    """One DECODE step of every row of `table` (the last key its new token), kvattn against SDPA
    on the contiguous per-request K/V (k_seq / v_seq: [batch, kv_len, heads, dim])."""
    batch, kv_len = table.shape
    ints = lambda values: torch.tensor(values, dtype=torch.int32)
    fb = kvattn.ForwardBatch("DECODE", batch, req_pool_indices=ints(list(range(batch))),
                             seq_lens=ints([kv_len] * batch), seq_lens_cpu=[kv_len] * batch,
                             out_cache_loc=table[:, -1].contiguous(), req_to_token_pool=pool,
                             kv_cache=cache)
    backend.init_forward_metadata(fb)
    layer = kvattn.AttentionLayer(num_q_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
                                  scaling=DIM ** -0.5)
    q = torch.randn(batch, Q_HEADS, DIM).to(DTYPE)
    ours = lambda: backend.forward(q, None, None, layer, fb, save_kv_cache=False)
    qs = q.view(batch, Q_HEADS, 1, DIM)
    ks, vs = k_seq.transpose(1, 2).contiguous(), v_seq.transpose(1, 2).contiguous()
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)
    diff = rel_diff(ours().view(batch, Q_HEADS, DIM), sdpa().view(batch, Q_HEADS, DIM))
    t_ours, t_sdpa = timed(ours, 5), timed(sdpa, 5)
    gbytes = batch * kv_len * KV_HEADS * DIM * 2 * 2 / 1e9  # K/V as read without sharing
    return dict(kvattn_ms=t_ours * 1e3, sdpa_ms=t_sdpa * 1e3, kvattn_rate=gbytes / t_ours,
                sdpa_rate=gbytes / t_sdpa, unit="GB/s", max_rel_diff=diff)


def decode_row(batch, kv_len, threads):
    cache, pool, backend, table, k_seq, v_seq = world(batch, kv_len, threads, 1)
    return time_decode(backend, cache, pool, table, k_seq, v_seq)


def shared_prefix_row(batch, shared, own, threads):
    """DECODE where every request's first `shared` keys are the same slots (a system prompt) and
    `own` more are its own: kvattn's cascade path reads the shared keys once per group (run with
    KVATTN_CASCADE=0 for the plain path); SDPA gets each request's keys as a contiguous copy."""
    g = torch.Generator().manual_seed(4)
    kv_len = shared + own
    slots = shared + batch * own + 1
    k_pool = torch.randn(slots, KV_HEADS, DIM, generator=g).to(DTYPE)
    v_pool = torch.randn(slots, KV_HEADS, DIM, generator=g).to(DTYPE)
    order = torch.randperm(slots - 1, generator=g).to(torch.int32) + 1
    prompt = order[:shared]
    table = torch.empty(batch, kv_len, dtype=torch.int32)
    for r in range(batch):
        table[r, :shared] = prompt
        table[r, shared:] = order[shared + r * own: shared + (r + 1) * own]
    cache, pool, backend = backend_over(k_pool, v_pool, table, threads)
    result = time_decode(backend, cache, pool, table, k_pool[table.long()],
                         v_pool[table.long()])
    result["cascade"] = os.environ.get("KVATTN_CASCADE", "1") != "0"
    return result


def prefill_row(n, threads):
    cache, pool, backend, table, _, _ = world(1, n, threads, 2)
    ints = lambda values: torch.tensor(values, dtype=torch.int32)
    fb = kvattn.ForwardBatch("EXTEND", 1, req_pool_indices=ints([0]), seq_lens=ints([n]),
                             seq_lens_cpu=[n], extend_prefix_lens=ints([0]),
                             extend_prefix_lens_cpu=[0], extend_seq_lens=ints([n]),
                             extend_seq_lens_cpu=[n], out_cache_loc=table[0].contiguous(),
                             req_to_token_pool=pool, kv_cache=cache)
    backend.init_forward_metadata(fb)
    layer = kvattn.AttentionLayer(num_q_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
                                  scaling=DIM ** -0.5)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, h, DIM, generator=g).to(DTYPE) for h in (Q_HEADS, KV_HEADS, KV_HEADS))
    ours = lambda: backend.forward(q, k, v, layer, fb)
    qs, ks, vs = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                                    enable_gqa=True)
    diff = rel_diff(ours().view(n, Q_HEADS, DIM), sdpa()[0].transpose(0, 1))
    reps = 3 if n >= 4096 else 8
    t_ours, t_sdpa = timed(ours, reps), timed(sdpa, reps)
    gflop = 4 * Q_HEADS * DIM * n * n / 2 / 1e9
    return dict(kvattn_ms=t_ours * 1e3, sdpa_ms=t_sdpa * 1e3, kvattn_rate=gflop / t_ours,
                sdpa_rate=gflop / t_sdpa, unit="GFLOP/s", max_rel_diff=diff)


def rel_diff(a, b):
    a, b = a.float(), b.float()
    scale = b.abs().amax(dim=-1).clamp_min(1e-6)
    return ((a - b).abs().amax(dim=-1) / scale).max().item()


def cpu_description():
    """The CPU's model name and whether it has AMX-BF16 / AVX-512 BF16 (from /proc/cpuinfo)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and ":" in line:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return dict(model=model, amx_bf16="amx_bf16" in flags, avx512_bf16="avx512_bf16" in flags)


def git_commit():
    try:
        import subprocess
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - no git here: the JSON says so
        return "unknown"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--json", default="")
    parser.add_argument("--rows", default=".", help="regex over row labels")
    parser.add_argument("--deterministic", action="store_true",
                        help="kvattn in its batch-invariant mode (BackendConfig.deterministic)")
    args = parser.parse_args()
    global DETERMINISTIC
    DETERMINISTIC = args.deterministic
    torch.set_num_threads(args.threads)
    cpu = cpu_description()
    rows = [("decode b16 x 4096", lambda: decode_row(16, 4096, args.threads)),
            ("decode b64 x 4096", lambda: decode_row(64, 4096, args.threads)),
            ("prefill 1 x 1024 causal", lambda: prefill_row(1024, args.threads)),
            ("prefill 1 x 4096 causal", lambda: prefill_row(4096, args.threads)),
            ("decode b64 shared 8192 + 256 own", lambda: shared_prefix_row(64, 8192, 256,
                                                                           args.threads))]
    results = []
    print(f"kvattn CPU vs torch {torch.__version__} SDPA, {args.threads} threads, "
          f"{cpu['model']} (AMX-BF16 {cpu['amx_bf16']}, AVX-512 BF16 {cpu['avx512_bf16']}), "
          f"KVATTN_CPU_ISA={os.environ.get('KVATTN_CPU_ISA', '(default)')}")
    print(f"{'row':26s} {'kvattn ms':>10s} {'SDPA ms':>9s} {'kvattn rate':>14s} "
          f"{'SDPA rate':>14s} {'SDPA/kvattn':>11s} {'max rel diff':>12s}")
    for label, run in rows:
        if not re.search(args.rows, label):
            continue
        r = run()
        r["row"] = label
        r["sdpa_over_kvattn"] = r["sdpa_ms"] / r["kvattn_ms"]
        results.append(r)
        print(f"{label:26s} {r['kvattn_ms']:10.2f} {r['sdpa_ms']:9.2f} "
              f"{r['kvattn_rate']:9.1f} {r['unit']:4s} {r['sdpa_rate']:9.1f} {r['unit']:4s} "
              f"{r['sdpa_over_kvattn']:11.2f} {r['max_rel_diff']:12.2e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(commit=git_commit(), date=time.strftime("%Y-%m-%d"),
                           deterministic=args.deterministic,
                           threads=args.threads, torch=torch.__version__,
                           cpu_isa=os.environ.get("KVATTN_CPU_ISA", ""), cpu=cpu,
                           rows=results), f, indent=1)


if __name__ == "__main__":
    main()
