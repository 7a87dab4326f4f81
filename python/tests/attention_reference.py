"""The tests' side: an engine's host pools owned by NumPy (wrapped by kvattn, zero-copy), and a
float64 attention reference that is obviously correct and slow.

Unused KV slots hold NaN, so a kernel that reads outside a request's tokens fails loudly.
"""

from __future__ import annotations

import numpy as np

import kvattn
from kvattn._arrays import bf16_bits, bf16_to_float, fp8_to_float

# Storage arrays of each KV dtype (NumPy has no bf16/fp8: their bits travel as uints).
STORAGE_NUMPY = {"fp16": np.float16, "bf16": np.uint16, "fp8_e4m3": np.uint8,
                 "fp8_e5m2": np.uint8}
STORAGE_NAN = {"fp16": np.float16("nan"), "bf16": 0x7FC0, "fp8_e4m3": 0x7F, "fp8_e5m2": 0x7F}
# What a q/k/v/out array of each q dtype is in NumPy.
Q_NUMPY = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16}
# Error bars per q dtype, relative to each (token, head) row's largest |reference| value: the
# bars of the C++ scenario harness (src/reference/scenario.cpp gives the measured spread).
TOLERANCE = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1e-2}


def encode(values, dtype: str) -> np.ndarray:
    """float values -> storage array of `dtype` (round to nearest)."""
    values = np.asarray(values, dtype=np.float64)
    if dtype in ("fp32",):
        return values.astype(np.float32)
    if dtype == "fp16":
        return values.astype(np.float16)
    if dtype == "bf16":
        return bf16_bits(values.astype(np.float32))
    table = fp8_to_float(np.arange(256, dtype=np.uint8), dtype)
    finite = np.where(np.isfinite(table))[0]
    nearest = np.abs(values[..., None] - table[finite]).argmin(axis=-1)
    return finite[nearest].astype(np.uint8)


def decode(stored, dtype: str) -> np.ndarray:
    """storage array of `dtype` -> float64 (exact)."""
    stored = np.asarray(stored)
    if dtype in ("fp32", "fp16"):
        return stored.astype(np.float64)
    if dtype == "bf16":
        return bf16_to_float(stored).astype(np.float64)
    return fp8_to_float(stored, dtype)


def attention(q, k, v, scaling, logit_cap, visible):
    """q [nq, H, D], k [nk, Hk, D], v [nk, Hk, Dv], visible bool [nq, nk] -> [nq, H, Dv].

    float64; GQA by repeating each KV head over its group of q heads; a row that sees nothing
    is 0."""
    if k.shape[0] == 0:
        return np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    group = q.shape[1] // k.shape[1]
    kx = np.repeat(k, group, axis=1)
    vx = np.repeat(v, group, axis=1)
    logits = np.einsum("qhd,khd->hqk", q, kx) * scaling
    if logit_cap > 0:
        logits = logit_cap * np.tanh(logits / logit_cap)
    logits = np.where(visible[None], logits, -np.inf)
    row_max = logits.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    weights = np.where(visible[None], np.exp(logits - row_max), 0.0)
    total = weights.sum(axis=-1, keepdims=True)
    probs = np.divide(weights, total, out=np.zeros_like(weights), where=total > 0)
    return np.einsum("hqk,khd->qhd", probs, vx)


def causal_visible(q_positions, kv_positions, window=-1):
    """Token at position p sees kv positions [max(0, p - W), p] (W < 0: [0, p])."""
    q_pos = np.asarray(q_positions)[:, None]
    kv_pos = np.asarray(kv_positions)[None, :]
    visible = kv_pos <= q_pos
    if window >= 0:
        visible &= kv_pos >= q_pos - window
    return visible


class World:
    """An engine's host pools, owned by NumPy and wrapped by kvattn, plus a CPU backend."""

    def __init__(self, rng, *, num_layers=1, num_slots=1024, page_size=1, num_q_heads=4,
                 num_kv_heads=2, head_dim=16, v_head_dim=None, kv_dtype="fp16", q_dtype="fp32",
                 max_reqs=8, max_context_len=256, window=-1, encoder_decoder=False,
                 ragged_extend_threshold=4096, scramble=True, backend=True):
        self.rng = rng
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.kv_dtype = kv_dtype
        self.q_dtype = q_dtype
        self.window = window
        self.page_size = page_size
        storage = STORAGE_NUMPY[kv_dtype]
        self.k = [np.full((num_slots, num_kv_heads, head_dim), STORAGE_NAN[kv_dtype], storage)
                  for _ in range(num_layers)]
        self.v = [np.full((num_slots, num_kv_heads, self.v_head_dim), STORAGE_NAN[kv_dtype],
                          storage) for _ in range(num_layers)]
        self.config = kvattn.KvCacheConfig(
            num_layers=num_layers, num_slots=num_slots, num_kv_heads=num_kv_heads,
            head_dim=head_dim, v_head_dim=self.v_head_dim, page_size=page_size, dtype=kv_dtype)
        self.cache = kvattn.KvCache.wrap(self.config, self.k, self.v)
        self.req_to_token = np.zeros((max_reqs, max_context_len), np.int32)
        self.pool = kvattn.ReqToTokenPool.wrap(self.req_to_token)
        self.allocator = kvattn.SlotAllocator(num_slots, page_size)
        if scramble:  # hand pages out in a shuffled order, as a long-running engine would
            pages = self.allocator.allocate_pages(self.allocator.free_page_count)
            self.allocator.free_pages(rng.permutation(pages))
        self.token_slots = {}  # request -> list of slots, in token order
        self.backend_config = kvattn.BackendConfig(
            kv_cache=self.cache, req_to_token_pool=self.pool, num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, v_head_dim=self.v_head_dim,
            q_dtype=q_dtype, sliding_window_size=window, is_encoder_decoder=encoder_decoder,
            ragged_extend_threshold=ragged_extend_threshold)
        self.backend = kvattn.make_backend("cpu", self.backend_config) if backend else None

    # ---- pools -----------------------------------------------------------------------------

    def add_tokens(self, req: int, count: int) -> np.ndarray:
        """Slots for `count` more tokens of `req`, written into its req_to_token row."""
        slots = self.token_slots.setdefault(req, [])
        last = slots[-1] if slots else 0
        new = self.allocator.allocate_tokens(len(slots), last, count)
        self.req_to_token[req, len(slots):len(slots) + count] = new
        slots.extend(int(s) for s in new)
        return np.asarray(new, np.int32)

    def fill(self, slots, layers=None):
        """Random K/V (fresh, never zeros) into `slots` of every layer (or `layers`)."""
        slots = np.asarray(slots, np.int64)
        for layer in (range(len(self.k)) if layers is None else layers):
            scale_k, scale_v = self.cache.k_scale(layer), self.cache.v_scale(layer)
            k = self.rng.standard_normal((len(slots), self.num_kv_heads, self.head_dim))
            v = self.rng.standard_normal((len(slots), self.num_kv_heads, self.v_head_dim))
            self.k[layer][slots] = encode(k / scale_k if self._fp8 else k, self.kv_dtype)
            self.v[layer][slots] = encode(v / scale_v if self._fp8 else v, self.kv_dtype)

    @property
    def _fp8(self) -> bool:
        return self.kv_dtype.startswith("fp8")

    def kv(self, layer: int, slots):
        """K [n, Hk, D] and V [n, Hk, Dv] of `slots` in float64, as kvattn reads them."""
        slots = np.asarray(slots, np.int64)
        k = decode(self.k[layer][slots], self.kv_dtype)
        v = decode(self.v[layer][slots], self.kv_dtype)
        if self._fp8:
            k = k * self.cache.k_scale(layer)
            v = v * self.cache.v_scale(layer)
        return k, v

    # ---- arrays of the q dtype -------------------------------------------------------------

    def random_q(self, rows, heads=None, dim=None, scale=1.0):
        """(array in q dtype, its exact float64 values)."""
        heads = heads or self.num_q_heads
        dim = dim or self.head_dim
        values = self.rng.standard_normal((rows, heads, dim)) * scale
        stored = encode(values, self.q_dtype)
        return stored, decode(stored, self.q_dtype)

    def poisoned_out(self, rows):
        """An output array pre-filled with NaN: anything kvattn leaves unwritten fails."""
        width = self.num_q_heads * self.v_head_dim
        if self.q_dtype == "bf16":
            return np.full((rows, width), 0x7FC0, np.uint16)
        return np.full((rows, width), np.nan, Q_NUMPY[self.q_dtype])

    def out_f64(self, out):
        return decode(out, self.q_dtype).reshape(out.shape[0], self.num_q_heads,
                                                 self.v_head_dim)

    def layer(self, layer_id=0, **overrides):
        fields = dict(layer_id=layer_id, num_q_heads=self.num_q_heads,
                      num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                      v_head_dim=self.v_head_dim, scaling=self.head_dim ** -0.5,
                      sliding_window_size=self.window)
        fields.update(overrides)
        return kvattn.AttentionLayer(**fields)

    def batch(self, mode, reqs, seq_lens, **fields):
        """A ForwardBatch over this world's pools, host lengths given as int32 arrays."""
        seq = np.asarray(seq_lens, np.int32)
        return kvattn.ForwardBatch(
            mode, len(reqs), req_pool_indices=np.asarray(reqs, np.int32), seq_lens=seq,
            seq_lens_cpu=seq.copy(), seq_lens_sum=int(seq.sum()), req_to_token_pool=self.pool,
            kv_cache=self.cache, **fields)


def row_relative_error(actual, expected):
    """max over rows (the last axis) of max|actual - expected| / max|expected| of that row; a row
    whose reference is all zero must be zero too (else inf)."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    if expected.size == 0:
        return 0.0
    diff = np.abs(actual - expected).max(axis=-1)
    scale = np.abs(expected).max(axis=-1)
    rel = np.divide(diff, scale, out=np.where(diff > 0, np.inf, 0.0), where=scale > 0)
    return float(rel.max())


def assert_close(actual, expected, q_dtype, what=""):
    """Per (token, head) row (the last axis): max|actual - expected| <= tol * max|expected row|,
    with NaN anywhere failing. `expected` is [tokens, heads, v_head_dim]."""
    actual = np.asarray(actual, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert np.isfinite(actual).all(), f"{what}: non-finite output (unwritten or NaN read)"
    error = row_relative_error(actual, expected)
    assert error <= TOLERANCE[q_dtype], \
        f"{what}: max row-relative error {error:.3g} > {TOLERANCE[q_dtype]:.0e}"


def random_tree_mask(rng, num_tokens):
    """A draft tree of num_tokens: token i's parent is a random earlier token (0 is the root);
    mask[i][j] = 1 when j is i or one of its ancestors. Returns (mask, depth)."""
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, num_tokens)]
    mask = np.zeros((num_tokens, num_tokens), np.uint8)
    depth = np.zeros(num_tokens, np.int64)
    for i in range(num_tokens):
        j = i
        while j >= 0:
            mask[i, j] = 1
            j = parent[j]
        depth[i] = mask[i].sum() - 1
    return mask, depth
