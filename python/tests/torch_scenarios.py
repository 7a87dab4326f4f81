"""A miniature engine in the shape of SGLang (its ForwardMode, token_to_kv_pool,
req_to_token_pool, RadixAttention and ForwardBatch field names) driving
kvattn.torch_backend.KvattnAttnBackend, and a reference that gathers each request's KV and runs
torch.nn.functional.scaled_dot_product_attention on it. Used on the CPU (test_torch_backend.py)
and on the GPU (test_gpu_torch.py)."""

from __future__ import annotations

import enum
import types

import numpy as np
import torch
import torch.nn.functional as F

import kvattn
from kvattn.torch_backend import KvattnAttnBackend, KvattnMultiStepDraftBackend


class ForwardMode(enum.IntEnum):
    """SGLang's ForwardMode: the predicates the backend asks."""
    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()
    TARGET_VERIFY = enum.auto()
    DRAFT_EXTEND = enum.auto()

    def is_idle(self):
        return self == ForwardMode.IDLE

    def is_decode(self):
        return self == ForwardMode.DECODE

    def is_mixed(self):
        return self == ForwardMode.MIXED

    def is_target_verify(self):
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend(self):
        return self == ForwardMode.DRAFT_EXTEND

    def is_extend(self):
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND,
                        ForwardMode.TARGET_VERIFY)

    def is_decode_or_idle(self):
        return self.is_decode() or self.is_idle()


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class TokenToKVPool:
    """SGLang's MHATokenToKVPool layout: per layer [size + page_size, heads, dim]; fp8 stored as
    uint8 (store_dtype) with .dtype the fp8 type. Unused slots hold NaN."""

    def __init__(self, size, page_size, dtype, head_num, head_dim, v_head_dim, layer_num,
                 device, start_layer=0):
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.store_dtype = torch.uint8 if dtype in FP8 else dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.start_layer = start_layer
        self.device = device
        rows = size + page_size

        def poisoned(dim):
            if dim == 0:
                return None
            if self.store_dtype == torch.uint8:
                return torch.full((rows, head_num, dim), 0x7F, dtype=torch.uint8, device=device)
            return torch.full((rows, head_num, dim), float("nan"), dtype=dtype, device=device)

        self.k_buffer = [poisoned(head_dim) for _ in range(layer_num)]
        self.v_buffer = [poisoned(v_head_dim) for _ in range(layer_num)]

    def get_kv_buffer(self, layer_id):
        i = layer_id - self.start_layer
        return self.k_buffer[i], self.v_buffer[i]


class ReqToTokenPool:
    def __init__(self, size, max_context_len, device):
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)


def radix_attention(layer_id, num_q_heads, num_kv_heads, head_dim, v_head_dim=None, *,
                    logit_cap=0.0, sliding_window_size=-1, is_cross_attention=False,
                    k_scale=None, v_scale=None):
    """An object with RadixAttention's field names."""
    v_head_dim = v_head_dim or head_dim
    return types.SimpleNamespace(
        layer_id=layer_id, tp_q_head_num=num_q_heads, tp_k_head_num=num_kv_heads,
        tp_v_head_num=num_kv_heads, head_dim=head_dim, qk_head_dim=head_dim,
        v_head_dim=v_head_dim, scaling=head_dim ** -0.5, logit_cap=logit_cap,
        sliding_window_size=sliding_window_size, is_cross_attention=is_cross_attention,
        k_scale=k_scale, v_scale=v_scale)


class Engine:
    """Pools, a page allocator and a KvattnAttnBackend on `device`, plus the reference."""

    def __init__(self, device, *, num_q_heads=8, num_kv_heads=2, head_dim=64, v_head_dim=None,
                 page_size=1, kv_dtype=torch.bfloat16, q_dtype=torch.bfloat16, size=8192,
                 max_reqs=16, max_context_len=4096, window=None, num_layers=1, seed=0,
                 fp8_scale=1.0, **backend_options):
        self.device = torch.device(device)
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.kv_dtype = kv_dtype
        self.q_dtype = q_dtype
        self.window = window
        self.fp8_scale = fp8_scale
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.token_to_kv_pool = TokenToKVPool(size, page_size, kv_dtype, num_kv_heads, head_dim,
                                              self.v_head_dim, num_layers, self.device)
        self.req_to_token_pool = ReqToTokenPool(max_reqs, max_context_len, self.device)
        self.allocator = kvattn.SlotAllocator(size + page_size, page_size)
        pages = self.allocator.allocate_pages(self.allocator.free_page_count)
        self.allocator.free_pages(np.random.default_rng(seed).permutation(pages))
        self.token_slots = {}
        self.backend = KvattnAttnBackend(
            self.token_to_kv_pool, self.req_to_token_pool, num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, v_head_dim=self.v_head_dim,
            q_dtype=q_dtype, sliding_window_size=window, **backend_options)
        if kv_dtype in FP8:
            for layer in range(num_layers):
                self.backend.kv_cache.set_scales(layer, fp8_scale, fp8_scale)

    def layer(self, layer_id=0, **overrides):
        fields = dict(sliding_window_size=-1 if self.window is None else self.window)
        fields.update(overrides)
        return radix_attention(layer_id, self.num_q_heads, self.num_kv_heads, self.head_dim,
                               self.v_head_dim, **fields)

    def randn(self, *shape, dtype=None, scale=1.0):
        values = torch.randn(*shape, generator=self.generator, dtype=torch.float32) * scale
        return values.to(device=self.device, dtype=dtype or self.q_dtype)

    # ---- pools ------------------------------------------------------------------------------

    def add_tokens(self, req, count):
        slots = self.token_slots.setdefault(req, [])
        last = slots[-1] if slots else 0
        new = self.allocator.allocate_tokens(len(slots), last, count)
        self.req_to_token_pool.req_to_token[req, len(slots):len(slots) + count] = \
            torch.from_numpy(new).to(self.device)
        slots.extend(int(s) for s in new)
        return torch.from_numpy(new.astype(np.int64)).to(self.device)

    def _store(self, values):
        if self.kv_dtype in FP8:
            return (values / self.fp8_scale).to(self.kv_dtype).view(torch.uint8)
        return values.to(self.kv_dtype)

    def fill(self, slots):
        for k, v in zip(self.token_to_kv_pool.k_buffer, self.token_to_kv_pool.v_buffer):
            k[slots] = self._store(self.randn(len(slots), self.num_kv_heads, self.head_dim,
                                              dtype=torch.float32))
            v[slots] = self._store(self.randn(len(slots), self.num_kv_heads, self.v_head_dim,
                                              dtype=torch.float32))

    def kv(self, layer_id, slots):
        """Gathered K [n, Hk, D], V [n, Hk, Dv] of a request, dequantised to float32."""
        index = torch.as_tensor(slots, dtype=torch.long, device=self.device)
        k = self.token_to_kv_pool.k_buffer[layer_id][index]
        v = self.token_to_kv_pool.v_buffer[layer_id][index]
        if self.kv_dtype in FP8:
            return (k.view(self.kv_dtype).float() * self.fp8_scale,
                    v.view(self.kv_dtype).float() * self.fp8_scale)
        return k.float(), v.float()

    # ---- batches ----------------------------------------------------------------------------

    def batch(self, mode, reqs, seq_lens, **fields):
        seq = torch.tensor(seq_lens, dtype=torch.int64)
        fb = types.SimpleNamespace(
            forward_mode=mode, batch_size=len(reqs),
            req_pool_indices=torch.tensor(reqs, dtype=torch.int64, device=self.device),
            seq_lens=seq.to(self.device), seq_lens_cpu=seq, seq_lens_sum=int(seq.sum()),
            extend_prefix_lens=None, extend_prefix_lens_cpu=None, extend_seq_lens=None,
            extend_seq_lens_cpu=None, out_cache_loc=None, encoder_lens=None, positions=None,
            spec_info=None, token_to_kv_pool=self.token_to_kv_pool,
            req_to_token_pool=self.req_to_token_pool, attn_backend=self.backend)
        for name, value in fields.items():
            setattr(fb, name, value)
        return fb


def sdpa_reference(q, k, v, scaling, visible, sinks=None):
    """torch SDPA in float32 on gathered KV: q [n, H, D], k [m, Hk, D], v [m, Hk, Dv],
    visible bool [n, m] -> [n, H, Dv]. With sinks ([H]): the softmax written out, one more
    logit per head with a zero value (gpt-oss's attention sinks)."""
    group = q.shape[1] // k.shape[1]
    qh = q.float().transpose(0, 1).unsqueeze(0)
    kh = k.float().repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    vh = v.float().repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    if sinks is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible[None, None],
                                             scale=scaling)
        return out[0].transpose(0, 1)
    logits = (qh[0] @ kh[0].transpose(-1, -2)) * scaling  # [H, n, m]
    logits = logits.masked_fill(~visible[None], float("-inf"))
    sink = sinks.float().reshape(-1, 1, 1).expand(-1, logits.shape[1], 1)
    weights = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return (weights @ vh[0]).transpose(0, 1)


def causal_visible(q_positions, kv_len, window, device):
    q_pos = torch.as_tensor(q_positions, device=device)[:, None]
    kv_pos = torch.arange(kv_len, device=device)[None, :]
    visible = kv_pos <= q_pos
    if window is not None and window >= 0:
        visible &= kv_pos >= q_pos - window
    return visible


def assert_close(actual, expected, dtype, what="", row_len=None):
    """Per (token, head) row of `row_len` values (the last axis when None): max|actual - expected|
    <= tol * max|expected row|, with NaN anywhere failing. The bars of the C++ scenario harness
    (fp16 2e-3, bf16 1e-2), fp32 2e-5: the SDPA reference here computes in fp32 itself, its
    error adds to kvattn's (1e-5). Returns the worst row-relative error."""
    tolerance = {torch.float32: 2e-5, torch.float16: 2e-3}.get(dtype, 1e-2)
    actual = actual.float()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.isfinite(actual).all(), f"{what}: non-finite output"
    if expected.numel() == 0:
        return 0.0
    row_len = row_len or expected.shape[-1]
    a = actual.double().reshape(-1, row_len)
    e = expected.double().reshape(-1, row_len)
    diff = (a - e).abs().amax(dim=-1)
    scale = e.abs().amax(dim=-1)
    rel = torch.where(scale > 0, diff / scale.clamp_min(1e-300),
                      torch.where(diff > 0, float("inf"), 0.0))
    error = rel.max().item()
    assert error <= tolerance, f"{what}: max row-relative error {error:.3g} > {tolerance:.0e}"
    return error


# ---- steps: each runs the backend as an engine would and returns the worst relative error ------

def extend_like_step(engine, mode, prefix_lens, extend_lens, *, layer=None, ragged=False,
                     sinks=None):
    """EXTEND / MIXED / DRAFT_EXTEND (and DECODE when mode is DECODE with extend_lens all 1).
    sinks: [num_q_heads] attention sinks passed to forward (as gpt-oss passes them)."""
    layer = layer or engine.layer()
    reqs = list(range(len(prefix_lens)))
    new = []
    for r, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        if p:
            engine.fill(engine.add_tokens(r, p))
        new.append(engine.add_tokens(r, e))
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)])
    fields = dict(out_cache_loc=torch.cat(new), positions=positions.to(engine.device))
    if mode != ForwardMode.DECODE:
        fields.update(
            extend_prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32, device=engine.device),
            extend_prefix_lens_cpu=list(prefix_lens),
            extend_seq_lens=torch.tensor(extend_lens, dtype=torch.int32, device=engine.device),
            extend_seq_lens_cpu=list(extend_lens), extend_num_tokens=int(sum(extend_lens)))
    fb = engine.batch(mode, reqs, seq, **fields)
    engine.backend.init_forward_metadata(fb)
    n = int(sum(extend_lens))
    q = engine.randn(n, layer.tp_q_head_num * layer.head_dim)
    k = engine.randn(n, layer.tp_k_head_num, layer.head_dim)
    v = engine.randn(n, layer.tp_k_head_num, layer.v_head_dim)
    extra = {} if sinks is None else {"sinks": sinks}
    out = engine.backend.forward(q, k, v, layer, fb, **extra)
    assert out.shape == (n, layer.tp_q_head_num * layer.v_head_dim)
    assert out.dtype == q.dtype and out.device == q.device

    expected = []
    row = 0
    q3 = q.view(n, layer.tp_q_head_num, layer.head_dim)
    for r, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        kk, vv = engine.kv(layer.layer_id, engine.token_slots[r][:p + e])
        if ragged:  # the ragged path attends to the new K/V as given, not their stored copy
            kk[p:] = k[row:row + e].float()
            vv[p:] = v[row:row + e].float()
        visible = causal_visible(range(p, p + e), p + e, layer.sliding_window_size,
                                 engine.device)
        expected.append(sdpa_reference(q3[row:row + e], kk, vv, layer.scaling, visible, sinks))
        row += e
    expected = torch.cat(expected).reshape(n, -1)
    return assert_close(out, expected, engine.q_dtype, mode.name, row_len=layer.v_head_dim)


def decode_step(engine, prefix_lens, *, layer=None, sinks=None):
    return extend_like_step(engine, ForwardMode.DECODE, prefix_lens, [1] * len(prefix_lens),
                            layer=layer, sinks=sinks)


def verify_step(engine, prefix_lens, draft_token_num, seed=0, sinks=None):
    rng = np.random.default_rng(seed)
    layer = engine.layer()
    reqs = list(range(len(prefix_lens)))
    masks, new = [], []
    for r, p in enumerate(prefix_lens):
        engine.fill(engine.add_tokens(r, p))
        new.append(engine.add_tokens(r, draft_token_num))
        parent = [-1] + [int(rng.integers(0, i)) for i in range(1, draft_token_num)]
        tree = np.zeros((draft_token_num, draft_token_num), bool)
        for i in range(draft_token_num):
            j = i
            while j >= 0:
                tree[i, j] = True
                j = parent[j]
        masks.append(np.concatenate([np.ones((draft_token_num, p), bool), tree], axis=1))
    custom_mask = torch.from_numpy(np.concatenate([m.reshape(-1) for m in masks]))
    spec_info = types.SimpleNamespace(custom_mask=custom_mask.to(engine.device),
                                      draft_token_num=draft_token_num)
    fb = engine.batch(ForwardMode.TARGET_VERIFY, reqs, prefix_lens, out_cache_loc=torch.cat(new),
                      spec_info=spec_info)
    engine.backend.init_forward_metadata(fb)
    n = len(reqs) * draft_token_num
    q = engine.randn(n, layer.tp_q_head_num, layer.head_dim)
    k = engine.randn(n, layer.tp_k_head_num, layer.head_dim)
    v = engine.randn(n, layer.tp_k_head_num, layer.v_head_dim)
    extra = {} if sinks is None else {"sinks": sinks}
    out = engine.backend.forward(q, k, v, layer, fb, **extra)
    expected = []
    for r, p in enumerate(prefix_lens):
        rows = slice(r * draft_token_num, (r + 1) * draft_token_num)
        kk, vv = engine.kv(0, engine.token_slots[r][:p + draft_token_num])
        visible = torch.from_numpy(masks[r]).to(engine.device)
        expected.append(sdpa_reference(q[rows], kk, vv, layer.scaling, visible, sinks))
    return assert_close(out, torch.cat(expected).reshape(n, -1), engine.q_dtype, "TARGET_VERIFY",
                        row_len=layer.v_head_dim)


def multi_step_draft(engine, seq_lens, topk, num_steps, sinks=None):
    draft = KvattnMultiStepDraftBackend(
        engine.token_to_kv_pool, engine.req_to_token_pool, topk, num_steps,
        num_q_heads=engine.num_q_heads, q_dtype=engine.q_dtype)
    layer = engine.layer()
    bs = len(seq_lens)
    for r, s in enumerate(seq_lens):
        engine.fill(engine.add_tokens(r, s))
        engine.add_tokens(r, topk * num_steps)
    fb = engine.batch(ForwardMode.DECODE, list(range(bs)), seq_lens,
                      spec_info=types.SimpleNamespace(topk=topk, num_steps=num_steps))
    draft.init_forward_metadata(fb)
    worst = 0.0
    rows = bs * topk
    for step in range(num_steps):
        loc = torch.tensor([engine.token_slots[r][seq_lens[r] + step * topk + b]
                            for r in range(bs) for b in range(topk)], device=engine.device)
        step_fb = engine.batch(ForwardMode.DECODE, list(range(bs)), seq_lens, out_cache_loc=loc)
        q = engine.randn(rows, layer.tp_q_head_num, layer.head_dim)
        k = engine.randn(rows, layer.tp_k_head_num, layer.head_dim)
        v = engine.randn(rows, layer.tp_k_head_num, layer.v_head_dim)
        extra = {} if sinks is None else {"sinks": sinks}
        out = draft.attn_backends[step].forward(q, k, v, layer, step_fb, **extra)
        expected = []
        for r in range(bs):
            for b in range(topk):
                positions = list(range(seq_lens[r])) + [seq_lens[r] + t * topk + b
                                                        for t in range(step + 1)]
                kk, vv = engine.kv(0, [engine.token_slots[r][p] for p in positions])
                row = r * topk + b
                visible = torch.ones((1, len(positions)), dtype=torch.bool, device=engine.device)
                expected.append(sdpa_reference(q[row:row + 1], kk, vv, layer.scaling, visible,
                                               sinks))
        worst = max(worst, assert_close(out, torch.cat(expected).reshape(rows, -1),
                                        engine.q_dtype, f"draft step {step}",
                                        row_len=layer.v_head_dim))
    return worst


def shared_prefix_requests(engine, prompt_len, own_lens, members):
    """Requests 0..len(own_lens)-1 with `own_lens` tokens of their own each; those in `members`
    first hold the slots of one prompt_len-token prompt (as an engine's radix cache hands them
    out: the prompt's slots, then the request's own). prompt_len: a multiple of the page size."""
    prompt = engine.add_tokens(members[0], prompt_len)
    engine.fill(prompt)
    for r in members[1:]:
        engine.req_to_token_pool.req_to_token[r, :prompt_len] = prompt.to(torch.int32)
        engine.token_slots[r] = [int(s) for s in prompt]
    for r, own in enumerate(own_lens):
        engine.fill(engine.add_tokens(r, own))


def shared_prefix_decode_step(engine, num_reqs, *, layer=None, check=True, **groups):
    """A DECODE step of requests 0..num_reqs-1 (one new token each); `groups`: the forward
    batch's shared_prefix_group_cpu / shared_prefix_lens_cpu attributes. Returns the worst
    relative error against SDPA over each request's whole row (check=False: the output is not
    compared, for a step the backend refuses)."""
    layer = layer or engine.layer()
    reqs = list(range(num_reqs))
    new = [engine.add_tokens(r, 1) for r in reqs]
    seq = [len(engine.token_slots[r]) for r in reqs]
    fb = engine.batch(ForwardMode.DECODE, reqs, seq, out_cache_loc=torch.cat(new), **groups)
    engine.backend.init_forward_metadata(fb)
    n = num_reqs
    q = engine.randn(n, layer.tp_q_head_num * layer.head_dim)
    k = engine.randn(n, layer.tp_k_head_num, layer.head_dim)
    v = engine.randn(n, layer.tp_k_head_num, layer.v_head_dim)
    out = engine.backend.forward(q, k, v, layer, fb)
    if not check:
        return None
    q3 = q.view(n, layer.tp_q_head_num, layer.head_dim)
    expected = []
    for r in reqs:
        kk, vv = engine.kv(layer.layer_id, engine.token_slots[r])
        visible = torch.ones(1, len(engine.token_slots[r]), dtype=torch.bool,
                             device=engine.device)
        expected.append(sdpa_reference(q3[r:r + 1], kk, vv, layer.scaling, visible))
    return assert_close(out, torch.cat(expected).reshape(n, -1), engine.q_dtype,
                        "DECODE with shared-prefix groups", row_len=layer.v_head_dim)
