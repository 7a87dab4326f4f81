"""The torch-free half of the peer benchmark (issue 5): the SPEC section 6 grid plus the
speculative-decoding rows (issue 19: TARGET_VERIFY, DRAFT_EXTEND, multi-step draft), the result
rows, and the JSON / markdown / PNG writers. run_peers.py imports this; its --self-test drives it
with made-up timings on a machine without torch or a GPU."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Dict, Iterable, List, Optional, Sequence

# Model shape of SPEC section 6 (Llama-3-8B on one GPU).
Q_HEADS = 32
KV_HEADS = 8
HEAD_DIM = 128
GROUP = Q_HEADS // KV_HEADS

# The fp8 and sliding-window decode rows: one shape each, large enough to be bandwidth-bound.
FP8_DECODE = dict(batch=64, kv_len=16384, page_size=16)
WINDOW_DECODE = dict(batch=64, kv_len=16384, page_size=16, window=4096)

# Speculative decoding (issue 19), page 1 with shuffled slots as the decode rows. TARGET_VERIFY:
# (batch, prefix, tree tokens) of an EAGLE-style tree, the first two in --quick. DRAFT_EXTEND:
# (batch, prefix, accepted tokens). Multi-step draft: (batch, prefix, topk, steps).
VERIFY_ROWS = ((1, 4096, 8), (16, 4096, 8), (64, 4096, 8), (64, 1024, 16))
VERIFY_QUICK = ((1, 4096, 8), (16, 4096, 8))
DRAFT_EXTEND_ROWS = ((16, 4096, 4), (64, 4096, 4))
MULTISTEP_DRAFT_ROWS = ((16, 4096, 4, 3),)
# Shared-prefix decode (issue 16): (batch, shared prefix, own tokens a request), page 1 and 16.
CASCADE_ROWS = ((64, 8192, 256),)

KVATTN = "kvattn"
# Every implementation name, in the order tables show them. FlashInfer names follow the wrapper
# and backend (paged unless "-ragged"); "+merge" is the reference backend's extend path
# (ragged over the new tokens, paged over the prefix, merge_state).
PEER_ORDER = (
    "flashinfer-decode", "flashinfer-decode-tc", "flashinfer-cascade",
    "flashinfer-fa2", "flashinfer-fa2-graph", "flashinfer-fa3",
    "flashinfer-fa2-ragged", "flashinfer-fa3-ragged",
    "flashinfer-fa2-ragged+merge", "flashinfer-fa3-ragged+merge",
    "torch-sdpa-flash", "torch-sdpa-cudnn", "torch-flex",
)
TORCH_PEERS = ("torch-sdpa-flash", "torch-sdpa-cudnn", "torch-flex")
# Workloads whose rate is bytes of K+V read (GB/s): a few query tokens per request over a long
# prefix. verify / draft rows also carry tflops; their SPEC `fraction` is of the GEMM ceiling
# (SPEC section 6: "of gemm_bf16_tflops for the others"), `read_fraction` of the read ceiling.
MEMORY_BOUND = ("decode", "verify", "draft")
WORKLOADS = ("decode", "prefill", "extend", "verify", "draft")


@dataclasses.dataclass(frozen=True)
class Case:
    """One grid row's workload. kv_len counts every KV token a request attends over (decode: the
    context; extend: prefix + new; verify: prefix + tree tokens; multi-step draft: prefix + topk x
    steps draft tokens); qo_len the query tokens per request (verify: the tree tokens; multi-step
    draft: topk x steps rows, topk per step)."""
    # decode, prefill, extend, verify (TARGET_VERIFY), draft (DRAFT_EXTEND, multi-step draft)
    workload: str
    batch: int
    kv_len: int
    qo_len: int = 1
    prefix_len: int = 0
    page_size: int = 1
    head_dim: int = HEAD_DIM
    kv_dtype: str = "bf16"  # bf16 or fp8_e4m3
    window: int = -1  # sliding window (left tokens), -1 = full attention
    variant: str = ""
    in_quick: bool = False
    topk: int = 0  # multi-step draft: branches per request (0: not a multi-step draft row)
    num_steps: int = 0  # multi-step draft: draft decode steps
    # Shared-prefix decode (issue 16): every request's first shared_prefix tokens are the same
    # (one prompt, its pages stored once); variant "cascade-..." declares the requests one
    # shared-prefix group to kvattn, "no-cascade-..." declares none (kvattn's plain path).
    shared_prefix: int = 0

    @property
    def is_shared_prefix(self) -> bool:
        return self.shared_prefix > 0

    @property
    def declares_groups(self) -> bool:
        return self.is_shared_prefix and self.variant.startswith("cascade")

    @property
    def is_decode(self) -> bool:
        return self.workload == "decode"

    @property
    def is_verify(self) -> bool:
        return self.workload == "verify"

    @property
    def is_multistep(self) -> bool:
        return self.workload == "draft" and self.topk > 0

    @property
    def is_draft_extend(self) -> bool:
        return self.workload == "draft" and self.topk == 0

    @property
    def memory_bound(self) -> bool:
        return self.workload in MEMORY_BOUND

    @property
    def kvattn_graph(self) -> bool:
        """kvattn's calls timed in a CUDA graph: DECODE, and TARGET_VERIFY / the multi-step draft
        on the graph buffers (init_cuda_graph_state) as an engine runs them. kvattn captures no
        EXTEND-like step (prefill, extend, DRAFT_EXTEND): those are timed in eager loops, and
        neither a decode step with shared-prefix groups (kvattn runs it eagerly)."""
        return (self.is_decode and not self.declares_groups) or self.is_verify or \
            self.is_multistep

    @property
    def tokens(self) -> int:
        return self.batch * self.qo_len

    @property
    def kv_elem_bytes(self) -> int:
        return 1 if self.kv_dtype.startswith("fp8") else 2

    @property
    def attended_kv_len(self) -> int:
        """KV tokens one decode query reads: the window's window + 1, else the whole context."""
        if self.window >= 0:
            return min(self.kv_len, self.window + 1)
        return self.kv_len

    def kv_bytes(self) -> float:
        """Bytes of K and V read, each distinct token once per call (SPEC section 6 for decode).
        Verify / DRAFT_EXTEND: the prefix and the new tokens of every request. Multi-step draft
        (one call = all steps): step t reads the prefix and the topk x (t + 1) draft tokens so
        far of each request, the prefix counted once, not once per branch."""
        per_token = KV_HEADS * 2.0 * self.head_dim * self.kv_elem_bytes
        if self.is_shared_prefix:  # the prompt once, then every request's own tokens
            own = self.kv_len - self.shared_prefix
            return float(self.shared_prefix + self.batch * own) * per_token
        if self.is_multistep:
            tokens = sum(self.prefix_len + self.topk * (t + 1) for t in range(self.num_steps))
            return float(self.batch) * tokens * per_token
        return float(self.batch) * self.attended_kv_len * per_token

    def flops(self) -> float:
        """Prefill / extend: 4 b h d q (prefix + q / 2), the causal half of the new-token
        square (the same formula as the kvattn bench); verify and DRAFT_EXTEND use it too (for a
        tree it counts the tree part as if causal: an approximation, the prefix dominates).
        Multi-step draft: 4 h d per query row and key, b x topk rows over prefix + t + 1 keys in
        step t."""
        if self.is_multistep:
            keys = sum(self.prefix_len + t + 1 for t in range(self.num_steps))
            return 4.0 * self.batch * self.topk * Q_HEADS * self.head_dim * float(keys)
        return (4.0 * self.batch * Q_HEADS * self.head_dim * float(self.qo_len) *
                (self.prefix_len + self.qo_len / 2.0))

    @property
    def data_key(self) -> tuple:
        """Cases with the same data_key get the same logical inputs (q, K, V by request and
        position); they differ only in where the KV pool puts the tokens."""
        key = (self.workload, self.batch, self.kv_len, self.qo_len, self.prefix_len,
               self.head_dim, self.kv_dtype, self.window)
        # Multi-step and shared-prefix rows only, so the other rows keep their keys (and seeds,
        # and inputs).
        if self.shared_prefix:
            return key + ("shared", self.shared_prefix)
        return key + (self.topk, self.num_steps) if self.topk else key

    @property
    def label(self) -> str:
        page = f"page{self.page_size}-shuffled"
        if self.is_verify:
            return f"verify b{self.batch} prefix{self.prefix_len} tree{self.qo_len} {page}"
        if self.is_draft_extend:
            return f"draft-extend b{self.batch} prefix{self.prefix_len} new{self.qo_len} {page}"
        if self.is_multistep:
            return (f"draft-multistep b{self.batch} prefix{self.prefix_len} topk{self.topk} "
                    f"steps{self.num_steps} {page}")
        text = f"{self.workload} b{self.batch} kv{self.kv_len}"
        if self.is_shared_prefix:
            text += f" shared{self.shared_prefix}"
        if not self.is_decode:
            text += f" q{self.qo_len}"
        text += f" {self.variant}"
        if self.kv_dtype != "bf16":
            text += f" {self.kv_dtype}"
        return text

    def seed(self) -> int:
        """A seed from the data key alone, so two passes (and two layouts) build equal inputs."""
        value = 1469598103934665603
        for part in self.data_key:
            for ch in str(part):
                value = ((value ^ ord(ch)) * 1099511628211) % (1 << 61)
            value = (value * 31 + 7) % (1 << 61)
        return value % (1 << 31)

    def peers(self) -> List[str]:
        """The peer implementations this case is run through. Speculative rows: FlashInfer only
        (TARGET_VERIFY: the paged prefill wrapper with the tree as custom mask, plain and in
        FlashInfer's CUDA-graph mode; FA3 takes no custom mask in 0.6.13. DRAFT_EXTEND: paged
        prefill, causal. Multi-step draft: the decode wrapper per step)."""
        if self.is_verify:
            return ["flashinfer-fa2", "flashinfer-fa2-graph"]
        if self.is_draft_extend:
            return ["flashinfer-fa2", "flashinfer-fa3"]
        if self.is_multistep:
            return ["flashinfer-decode", "flashinfer-decode-tc"]
        if self.declares_groups:
            # Two-level MultiLevelCascadeAttentionWrapper: the prompt's pages for every query,
            # then each request's own pages, merged (FlashInfer's own cascade).
            return ["flashinfer-cascade"]
        if self.is_shared_prefix:
            return ["flashinfer-decode", "flashinfer-decode-tc"]
        if self.is_decode:
            names = ["flashinfer-decode", "flashinfer-decode-tc"]
        elif self.workload == "prefill":
            names = ["flashinfer-fa2", "flashinfer-fa3", "flashinfer-fa2-ragged",
                     "flashinfer-fa3-ragged"]
        else:
            names = ["flashinfer-fa2", "flashinfer-fa3", "flashinfer-fa2-ragged+merge",
                     "flashinfer-fa3-ragged+merge"]
        if self.kv_dtype.startswith("fp8"):
            # FA3 with bf16 q and fp8 KV does not compile on sm90 (vllm issue 31843).
            names = [n for n in names if "fa3" not in n]
        return names + list(TORCH_PEERS)

    def flashinfer_modules(self) -> List[tuple]:
        """FlashInfer JIT modules this case needs: (kind, kv_dtype, sliding_window)."""
        swa = self.window >= 0
        if self.is_verify:
            # The fa2 module holds every mask mode; plan() packs the bool mask with
            # segment_packbits, which loads the small "quantization" module.
            return [("fa2", self.kv_dtype, swa), ("quantization", "", False)]
        if self.declares_groups:
            return [("fa2", self.kv_dtype, swa), ("cascade", "", False)]
        if self.is_decode or self.is_multistep:
            return [("decode", self.kv_dtype, swa), ("fa2", self.kv_dtype, swa)]
        modules = [("fa2", self.kv_dtype, swa)]
        if not self.kv_dtype.startswith("fp8"):
            modules.append(("fa3", self.kv_dtype, swa))
        if self.workload == "extend":
            modules.append(("cascade", "", False))
        return modules


def make_grid(quick: bool = False) -> List[Case]:
    """The SPEC section 6 grid at head_dim 128 plus an fp8-KV and a sliding-window decode row, in
    run order: both page layouts of one decode shape are adjacent (they share inputs)."""
    cases: List[Case] = []
    for batch in (1, 16, 64, 256):
        for kv_len in (1024, 4096, 16384, 32768):
            if kv_len == 32768 and batch > 16:
                continue  # SPEC section 6: 32768 only for batch <= 16
            for page_size in (1, 16):
                cases.append(Case("decode", batch, kv_len, page_size=page_size,
                                  variant=f"page{page_size}-shuffled",
                                  in_quick=batch in (1, 16, 64) and kv_len <= 4096))
    for batch, length in ((1, 1024), (1, 4096), (1, 16384), (8, 2048)):
        cases.append(Case("prefill", batch, length, qo_len=length, variant="causal",
                          in_quick=batch == 1 and length <= 4096))
    cases.append(Case("extend", 8, 4096 + 512, qo_len=512, prefix_len=4096, variant="causal",
                      in_quick=True))
    fp8 = FP8_DECODE
    cases.append(Case("decode", fp8["batch"], fp8["kv_len"], page_size=fp8["page_size"],
                      kv_dtype="fp8_e4m3", variant=f"page{fp8['page_size']}-shuffled",
                      in_quick=True))
    win = WINDOW_DECODE
    cases.append(Case("decode", win["batch"], win["kv_len"], page_size=win["page_size"],
                      window=win["window"],
                      variant=f"page{win['page_size']}-shuffled-window{win['window']}",
                      in_quick=True))
    cases.extend(speculative_cases())
    cases.extend(cascade_cases())
    if quick:
        cases = [c for c in cases if c.in_quick]
    return cases


def speculative_cases() -> List[Case]:
    """The issue-19 rows, after the SPEC grid (so the grid's run order is unchanged). DRAFT_EXTEND
    last: it alone needs FA3 (the slowest module to compile), and pass B measures in this order,
    waiting for each module it reaches."""
    cases = []
    for batch, prefix, tree in VERIFY_ROWS:
        cases.append(Case("verify", batch, prefix + tree, qo_len=tree, prefix_len=prefix,
                          variant="tree-page1-shuffled",
                          in_quick=(batch, prefix, tree) in VERIFY_QUICK))
    for batch, prefix, topk, steps in MULTISTEP_DRAFT_ROWS:
        cases.append(Case("draft", batch, prefix + topk * steps, qo_len=topk * steps,
                          prefix_len=prefix, topk=topk, num_steps=steps,
                          variant=f"multistep-topk{topk}-steps{steps}-page1-shuffled"))
    for batch, prefix, new in DRAFT_EXTEND_ROWS:
        cases.append(Case("draft", batch, prefix + new, qo_len=new, prefix_len=prefix,
                          variant="extend-causal-page1-shuffled"))
    return cases


def cascade_cases() -> List[Case]:
    """The issue-16 rows, last (the rows before keep their order, keys and seeds): per page size
    the cascade row and the same batch without groups, adjacent (they share inputs)."""
    cases = []
    for batch, shared, own in CASCADE_ROWS:
        for page_size in (1, 16):
            for variant in ("cascade", "no-cascade"):
                cases.append(Case("decode", batch, shared + own, prefix_len=shared,
                                  shared_prefix=shared, page_size=page_size,
                                  variant=f"{variant}-page{page_size}-shuffled"))
    return cases


_TINY_BATCH = {1: 1, 8: 2, 16: 2, 64: 3, 256: 4}


def tiny_case(case: Case) -> Case:
    """The CPU dry run's stand-in for a grid row: the same kind of row with lengths / 64 and
    batches shrunk (distinct shapes stay distinct), so the whole pipeline runs in seconds.
    Speculative rows keep their tree / new tokens, topk and steps; the prefix shrinks."""
    if case.workload in ("verify", "draft"):
        prefix = case.prefix_len // 64
        return dataclasses.replace(case, batch=_TINY_BATCH.get(case.batch, 2),
                                   prefix_len=prefix, kv_len=prefix + case.qo_len)
    return dataclasses.replace(
        case, batch=_TINY_BATCH.get(case.batch, 2), kv_len=case.kv_len // 64,
        qo_len=max(1, case.qo_len // 64) if not case.is_decode else 1,
        prefix_len=case.prefix_len // 64, shared_prefix=case.shared_prefix // 64,
        window=case.window // 64 if case.window >= 0 else -1,
        variant=case.variant.replace(f"window{case.window}", f"window{case.window // 64}"))


def group_by_data(cases: Sequence[Case]) -> List[List[Case]]:
    """Consecutive runs of cases that share inputs (grid order keeps them adjacent)."""
    groups: List[List[Case]] = []
    for case in cases:
        if groups and groups[-1][0].data_key == case.data_key:
            groups[-1].append(case)
        else:
            groups.append([case])
    return groups


def needed_flashinfer_modules(cases: Iterable[Case]) -> List[tuple]:
    """Distinct modules in the order pass B first uses them."""
    seen: List[tuple] = []
    for case in cases:
        for module in case.flashinfer_modules():
            if module not in seen:
                seen.append(module)
    return seen


# ---- rows ------------------------------------------------------------------------------------

def _finite(value: Optional[float]) -> Optional[float]:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def make_row(case: Case, impl: str, time_us: Optional[float], ceilings: Dict[str, float], *,
             max_rel_err: Optional[float] = None, error: str = "", **extra) -> dict:
    """A SPEC section 6 result row (plus run details: timing, note, error, ...). time_us None:
    the implementation did not run; `error` says why."""
    row = {
        "workload": case.workload, "impl": impl, "batch": case.batch, "kv_len": case.kv_len,
        "qo_len": case.qo_len, "prefix_len": case.prefix_len, "page_size": case.page_size,
        "head_dim": case.head_dim, "q_heads": Q_HEADS, "kv_heads": KV_HEADS,
        "kv_dtype": case.kv_dtype, "variant": case.variant, "time_us": _finite(time_us),
        "gbps": None, "tflops": None, "fraction": None,
        "max_rel_err": _finite(max_rel_err),
    }
    if max_rel_err is not None and not math.isfinite(float(max_rel_err)):
        extra.setdefault("note", "non-finite output or error")
    if row["time_us"] is not None and row["time_us"] > 0:
        seconds = row["time_us"] * 1e-6
        if case.is_decode:
            row["gbps"] = case.kv_bytes() / seconds / 1e9
            read = ceilings.get("read_gbps")
            row["fraction"] = row["gbps"] / read if read else None
        elif case.memory_bound:  # verify, draft: both rates; fraction of GEMM as SPEC says
            row["gbps"] = case.kv_bytes() / seconds / 1e9
            row["tflops"] = case.flops() / seconds / 1e12
            gemm = ceilings.get("gemm_bf16_tflops")
            read = ceilings.get("read_gbps")
            row["fraction"] = row["tflops"] / gemm if gemm else None
            row["read_fraction"] = row["gbps"] / read if read else None
        else:
            row["tflops"] = case.flops() / seconds / 1e12
            gemm = ceilings.get("gemm_bf16_tflops")
            row["fraction"] = row["tflops"] / gemm if gemm else None
    if case.window >= 0:
        row["window"] = case.window
    if case.topk:
        row["topk"] = case.topk
        row["num_steps"] = case.num_steps
    if case.shared_prefix:
        row["shared_prefix"] = case.shared_prefix
    if error:
        row["error"] = error
    for key, value in extra.items():
        row[key] = _finite(value) if isinstance(value, float) else value
    return row


def row_key(row: dict) -> tuple:
    return (row["workload"], row["batch"], row["kv_len"], row["qo_len"], row["prefix_len"],
            row["page_size"], row["head_dim"], row["kv_dtype"], row["variant"],
            row.get("topk", 0), row.get("num_steps", 0))


def case_of_row(row: dict) -> Case:
    return Case(row["workload"], row["batch"], row["kv_len"], qo_len=row["qo_len"],
                prefix_len=row["prefix_len"], page_size=row["page_size"],
                head_dim=row["head_dim"], kv_dtype=row["kv_dtype"],
                window=row.get("window", -1), variant=row["variant"],
                topk=row.get("topk", 0) or 0, num_steps=row.get("num_steps", 0) or 0,
                shared_prefix=row.get("shared_prefix", 0) or 0)


# ---- JSON --------------------------------------------------------------------------------------

def _rounded(value):
    """Floats to 6 significant digits (as the kvattn bench writes them), recursively."""
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def write_json(path: str, header: dict, rows: List[dict]) -> None:
    """The results file: the header's fields, then one row per line (as the kvattn bench writes
    them). Written to a temporary name and renamed, so a run killed mid-write leaves the last
    complete file."""
    lines = ["{" + ", ".join(f"{json.dumps(k)}: {json.dumps(_rounded(v), allow_nan=False)}"
                             for k, v in header.items()) + ","]
    lines.append(' "rows": [')
    body = [f"  {json.dumps(_rounded(r), allow_nan=False)}" for r in rows]
    lines.append(",\n".join(body))
    lines.append(" ]}")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)


# ---- markdown table ----------------------------------------------------------------------------

def _fmt_us(value: Optional[float]) -> str:
    if value is None:
        return "—"
    return f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def _fmt_err(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:.1e}"


def speed_ratio(kvattn_us: Optional[float], peer_us: Optional[float]) -> Optional[float]:
    """kvattn's speed over the peer's: peer time / kvattn time (> 1: kvattn is faster)."""
    if not kvattn_us or not peer_us:
        return None
    return peer_us / kvattn_us


def grouped_rows(rows: List[dict]) -> List[tuple]:
    """[(key, {impl: row})] in first-seen order."""
    order: List[tuple] = []
    by_key: Dict[tuple, Dict[str, dict]] = {}
    for row in rows:
        key = row_key(row)
        if key not in by_key:
            by_key[key] = {}
            order.append(key)
        by_key[key][row["impl"]] = row
    return [(key, by_key[key]) for key in order]


def best_peer(impls: Dict[str, dict]) -> tuple:
    """(name, time_us) of the fastest peer that ran, or (None, None)."""
    best = (None, None)
    for name, row in impls.items():
        if name == KVATTN or row.get("time_us") is None:
            continue
        if best[1] is None or row["time_us"] < best[1]:
            best = (name, row["time_us"])
    return best


def markdown_table(header: dict, rows: List[dict]) -> str:
    """One table per workload: kvattn's time, fraction of ceiling and error, then each peer's
    time with kvattn's speed ratio over it, the best peer, and kvattn's largest difference from
    FlashInfer. Then the rows where kvattn is slower than the best peer, and what failed."""
    ceilings = header.get("ceilings", {})
    out: List[str] = []
    out.append(f"# kvattn vs FlashInfer and PyTorch — {header.get('device', '?')}, "
               f"{header.get('date', '?')}, commit {str(header.get('commit', '?'))[:12]}")
    out.append("")
    out.append("Ceilings (this run): read {} GB/s, copy {} GB/s, bf16 GEMM 8192³ {} TFLOP/s. "
               "Fraction: decode of read, prefill/extend of GEMM; verify/draft (memory-bound: "
               "a few query tokens a request) of read here (their JSON `read_fraction`; the "
               "JSON `fraction` is of GEMM, as SPEC §6 says).".format(
                   _fmt_num(ceilings.get("read_gbps")), _fmt_num(ceilings.get("copy_gbps")),
                   _fmt_num(ceilings.get("gemm_bf16_tflops"))))
    versions = header.get("versions")
    if versions:
        out.append("Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".")
    out.append("Cells: peer µs (×r), r = peer time / kvattn time: r > 1 means kvattn is faster. "
               "err: max relative error against the float64 reference on sampled queries; "
               "Δ FI: largest relative difference between kvattn's and FlashInfer's full "
               "outputs. torch SDPA and flex read a contiguous KV copy (no paging, no gather): a "
               "lower bound for a paged kernel.")
    groups = grouped_rows(rows)
    slower: List[str] = []
    failures: List[str] = []
    for workload in WORKLOADS:
        mine = [(k, impls) for k, impls in groups if k[0] == workload]
        if not mine:
            continue
        peers = [p for p in PEER_ORDER if any(p in impls for _, impls in mine)]
        memory_bound = workload in MEMORY_BOUND
        unit = "GB/s" if memory_bound else "TFLOP/s"
        out.append("")
        out.append(f"## {workload}")
        out.append("")
        cols = ["row", "kvattn µs", f"kvattn {unit}", "frac", "err"] + \
            [p.replace("flashinfer-", "FI ").replace("torch-", "") for p in peers] + \
            ["best peer", "×best", "Δ FI"]
        out.append("| " + " | ".join(cols) + " |")
        out.append("|" + "---|" * len(cols))
        for key, impls in mine:
            mine_row = impls.get(KVATTN, {})
            label = case_of_row(next(iter(impls.values()))).label
            k_us = mine_row.get("time_us")
            rate = mine_row.get("gbps") if memory_bound else mine_row.get("tflops")
            frac = mine_row.get("fraction") if workload in ("decode", "prefill", "extend") \
                else mine_row.get("read_fraction")
            cells = [label, _fmt_us(k_us), _fmt_num(rate), _fmt_frac(frac),
                     _fmt_err(mine_row.get("max_rel_err"))]
            for peer in peers:
                row = impls.get(peer)
                if row is None:
                    cells.append("")
                elif row.get("time_us") is None:
                    cells.append(_not_run_cell(row.get("error", "")))
                else:
                    ratio = speed_ratio(k_us, row["time_us"])
                    cells.append(_fmt_us(row["time_us"]) +
                                 (f" (×{ratio:.2f})" if ratio is not None else ""))
            name, best_us = best_peer(impls)
            ratio = speed_ratio(k_us, best_us)
            cells.append(name.replace("flashinfer-", "FI ").replace("torch-", "")
                         if name else "—")
            cells.append(f"{ratio:.2f}" if ratio is not None else "—")
            cells.append(_fmt_err(mine_row.get("max_rel_diff_vs_flashinfer")))
            out.append("| " + " | ".join(cells) + " |")
            if ratio is not None and ratio < 1.0:
                slower.append(f"- {label}: kvattn {_fmt_us(k_us)} µs, {name} "
                              f"{_fmt_us(best_us)} µs: kvattn takes {1 / ratio:.2f}× the time")
            for impl, row in impls.items():
                if row.get("error"):
                    failures.append(f"- {label} / {impl}: {row['error']}")
    out.append("")
    out.append("## Rows where kvattn is slower than the best peer")
    out.append("")
    out.extend(slower or ["- none"])
    out.append("")
    out.append("## Implementations that did not run")
    out.append("")
    out.extend(failures or ["- none"])
    return "\n".join(out) + "\n"


def _not_run_cell(error: str) -> str:
    """'skip' for work left out on purpose (budget, unsupported by design), 'failed' for an
    error the run hit."""
    if error.startswith("skipped"):
        return "skip"
    if error.startswith("not run"):
        return "n/a"
    return "failed" if error else "—"


def _fmt_num(value: Optional[float]) -> str:
    if value is None:
        return "—"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _fmt_frac(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:.2f}"


# ---- plot ----------------------------------------------------------------------------------

def write_plot(path: str, header: dict, rows: List[dict]) -> Optional[str]:
    """A PNG of kvattn's speed ratio over each peer, by row (log scale; above 1: kvattn is
    faster). Returns None when written, else why not (no matplotlib, nothing to plot)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker  # noqa: F401  (matplotlib.ticker below)
    except ImportError as e:
        return "no matplotlib (" + " ".join(str(e).split())[:160] + ")"
    groups = grouped_rows(rows)
    labels = [case_of_row(next(iter(impls.values()))).label for _, impls in groups]
    series: Dict[str, List[Optional[float]]] = {}
    for index, (_, impls) in enumerate(groups):
        k_us = impls.get(KVATTN, {}).get("time_us")
        for peer in PEER_ORDER:
            row = impls.get(peer)
            if row is None:
                continue
            series.setdefault(peer, [None] * len(groups))[index] = \
                speed_ratio(k_us, row.get("time_us"))
    points = [v for values in series.values() for v in values if v]
    if not points:
        return "no ratios to plot"
    fig, ax = plt.subplots(figsize=(max(10.0, 0.38 * len(labels) + 3.0), 6.5))
    markers = "os^vD<>phX*P"
    xs = list(range(len(labels)))
    for i, (peer, values) in enumerate(series.items()):
        px = [x for x, v in zip(xs, values) if v]
        py = [v for v in values if v]
        if px:
            ax.plot(px, py, linestyle="none", marker=markers[i % len(markers)], markersize=6,
                    label=peer, alpha=0.85)
    ax.axhline(1.0, color="black", linewidth=1.0)
    ax.set_yscale("log")
    low, high = min(points), max(points)
    ax.set_ylim(min(0.5, low / 1.2), max(2.0, high * 1.2))
    ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator(
        [v for v in (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)]))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, rotation=75, ha="right", fontsize=7)
    ax.set_ylabel("speed ratio: peer time / kvattn time (>1: kvattn faster)")
    ax.set_title(f"kvattn vs peers — {header.get('device', '?')}, {header.get('date', '?')}, "
                 f"commit {str(header.get('commit', '?'))[:10]}")
    ax.grid(True, which="both", axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
