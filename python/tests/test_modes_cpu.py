"""Every forward mode of the CPU backend, through the Python binding with NumPy arrays, against
the float64 reference of attention_reference.py."""

from __future__ import annotations

import numpy as np
import pytest

import kvattn
from attention_reference import (World, assert_close, attention, causal_visible, decode, encode,
                                 random_tree_mask)


def make_rng(seed):
    return np.random.default_rng(seed)


def extend_step(world, mode, prefix_lens, extend_lens, *, layers=(0,), save=True,
                layer_overrides=None, q_scale=1.0, ragged=False):
    """One EXTEND-like step (DECODE when mode is DECODE: extend_lens all 1). Fills each request's
    prefix with random K/V, runs every layer in `layers`, checks the saved K/V and the output.

    ragged: the step takes the ragged path, which attends to the new tokens' K/V as given (in
    the q dtype), not to their copy rounded into the cache's storage dtype."""
    bs = len(prefix_lens)
    reqs = list(range(bs))
    new_slots = []
    for r, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        if p:
            world.fill(world.add_tokens(r, p))
        new_slots.append(world.add_tokens(r, e))
    loc = np.concatenate(new_slots).astype(np.int32)
    seq_lens = np.asarray(prefix_lens) + np.asarray(extend_lens)
    num_tokens = int(np.sum(extend_lens))
    fields = dict(out_cache_loc=loc)
    if mode != "DECODE":
        prefix = np.asarray(prefix_lens, np.int32)
        extend = np.asarray(extend_lens, np.int32)
        fields.update(extend_prefix_lens=prefix, extend_prefix_lens_cpu=prefix.copy(),
                      extend_seq_lens=extend, extend_seq_lens_cpu=extend.copy())
    batch = world.batch(mode, reqs, seq_lens, **fields)
    assert batch.num_tokens() == num_tokens
    world.backend.init_forward_metadata(batch)

    for layer_id in layers:
        layer = world.layer(layer_id, **(layer_overrides or {}))
        q, q64 = world.random_q(num_tokens, scale=q_scale)
        k, k64 = world.random_q(num_tokens, world.num_kv_heads, world.head_dim)
        v, v64 = world.random_q(num_tokens, world.num_kv_heads, world.v_head_dim)
        if not save:  # the caller wrote them: put them in the pool ourselves
            world.k[layer_id][loc] = encode(k64, world.kv_dtype)
            world.v[layer_id][loc] = encode(v64, world.kv_dtype)
        out = world.poisoned_out(num_tokens)
        returned = world.backend.forward(q, k if save else None, v if save else None, layer,
                                         batch, save_kv_cache=save, out=out)
        assert returned is out

        if save and not world.kv_dtype.startswith("fp8"):
            np.testing.assert_array_equal(world.k[layer_id][loc], encode(k64, world.kv_dtype))
            np.testing.assert_array_equal(world.v[layer_id][loc], encode(v64, world.kv_dtype))

        expected = np.empty((num_tokens, world.num_q_heads, world.v_head_dim))
        row = 0
        window = layer.sliding_window_size
        for r, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
            slots = world.token_slots[r][:p + e]
            kv_k, kv_v = world.kv(layer_id, slots)
            if ragged:
                kv_k[p:] = k64[row:row + e]
                kv_v[p:] = v64[row:row + e]
            visible = causal_visible(np.arange(p, p + e), np.arange(p + e), window)
            expected[row:row + e] = attention(q64[row:row + e], kv_k, kv_v, layer.scaling,
                                              layer.logit_cap, visible)
            row += e
        assert_close(world.out_f64(out), expected, world.q_dtype, f"{mode} layer {layer_id}")
    return batch


# ---- DECODE ------------------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_decode(page_size):
    world = World(make_rng(page_size), page_size=page_size, num_layers=2)
    # seq_len 1 (only the new token), non-multiples of the page, one exactly a page
    prefix = [0, 6, 16, 37]
    extend_step(world, "DECODE", prefix, [1] * len(prefix), layers=(0, 1))


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa4", "mqa"])
def test_decode_head_layouts_and_v_head_dim(heads):
    num_q_heads, num_kv_heads = heads
    world = World(make_rng(11), num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                  head_dim=16, v_head_dim=8, page_size=4)
    extend_step(world, "DECODE", [3, 20], [1, 1])


def test_decode_soft_cap_and_window():
    world = World(make_rng(12), window=5, page_size=2)
    extend_step(world, "DECODE", [0, 3, 5, 30], [1] * 4, layer_overrides=dict(logit_cap=4.0),
                q_scale=4.0)


def test_decode_without_saving():
    world = World(make_rng(13), page_size=4)
    extend_step(world, "DECODE", [9, 2], [1, 1], save=False)


def test_decode_bf16_q_and_cache_as_uint16_bits():
    world = World(make_rng(14), q_dtype="bf16", kv_dtype="bf16", page_size=8)
    extend_step(world, "DECODE", [12, 40], [1, 1])


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_decode_fp8_cache_with_scales(kv_dtype):
    world = World(make_rng(15), q_dtype="fp16", kv_dtype=kv_dtype, page_size=4)
    world.cache.set_scales(0, 0.5, 2.0)
    extend_step(world, "DECODE", [7, 21], [1, 1], save=False)
    # saving: fp8 holds k / k_scale, so reading back times the scale is k to fp8 precision
    batch_slot = world.add_tokens(0, 1)
    k = np.float16(np.linspace(-3, 3, world.num_kv_heads * world.head_dim)).reshape(
        1, world.num_kv_heads, world.head_dim)
    seq = np.array([len(world.token_slots[0])], np.int32)
    batch = world.batch("DECODE", [0], seq, out_cache_loc=batch_slot)
    world.backend.init_forward_metadata(batch)
    q, _ = world.random_q(1)
    world.backend.forward(q, k, k.copy(), world.layer(0), batch)
    stored_k, _ = world.kv(0, batch_slot)
    np.testing.assert_allclose(stored_k[0], k[0].astype(np.float64), rtol=0.13, atol=2e-2)


# ---- EXTEND, MIXED, DRAFT_EXTEND ------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_extend_with_cached_prefix(page_size):
    world = World(make_rng(20 + page_size), page_size=page_size, num_layers=2)
    # prefix 0 (kv_len of the prefix 0), extend 1, non-multiples of the page and of any tile
    extend_step(world, "EXTEND", [0, 5, 16, 0], [1, 7, 19, 33], layers=(0, 1))


def test_extend_ragged_path_matches_paged():
    # threshold 0: every extend takes the ragged + paged-prefix path (merge of two LSE states)
    world = World(make_rng(30), page_size=4, ragged_extend_threshold=0)
    extend_step(world, "EXTEND", [0, 9, 31], [5, 1, 17], ragged=True)


def test_extend_window_and_soft_cap():
    world = World(make_rng(31), window=6, page_size=4)
    extend_step(world, "EXTEND", [0, 4, 20], [9, 3, 13], layer_overrides=dict(logit_cap=3.0),
                q_scale=3.0)


def test_extend_bf16():
    world = World(make_rng(32), q_dtype="bf16", kv_dtype="bf16", num_q_heads=8, num_kv_heads=2)
    extend_step(world, "EXTEND", [3, 0], [6, 11])


def test_mixed_extend_and_decode_requests():
    world = World(make_rng(40), page_size=2)
    # requests 1 and 3 are decode requests: extend by one token after their prefix
    extend_step(world, "MIXED", [0, 12, 5, 30], [8, 1, 4, 1])


def test_draft_extend():
    world = World(make_rng(41), page_size=4, ragged_extend_threshold=0)
    # DRAFT_EXTEND always takes the paged path, whatever the ragged threshold says
    extend_step(world, "DRAFT_EXTEND", [10, 3], [3, 2])


# ---- TARGET_VERIFY -----------------------------------------------------------------------------

def verify_step(world, prefix_lens, draft_token_num, *, window=-1, rng=None):
    bs = len(prefix_lens)
    reqs = list(range(bs))
    tree_slots, masks, positions = [], [], []
    for r, p in enumerate(prefix_lens):
        world.fill(world.add_tokens(r, p))
        tree_slots.append(world.add_tokens(r, draft_token_num))
        tree, depth = random_tree_mask(rng, draft_token_num)
        full = np.concatenate([np.ones((draft_token_num, p), np.uint8), tree], axis=1)
        masks.append(full)
        positions.append(p + depth)
    loc = np.concatenate(tree_slots).astype(np.int32)
    custom_mask = np.concatenate([m.reshape(-1) for m in masks]).astype(bool)
    pos = np.concatenate(positions).astype(np.int64)
    batch = world.batch("TARGET_VERIFY", reqs, prefix_lens, out_cache_loc=loc,
                        custom_mask=custom_mask, draft_token_num=draft_token_num, positions=pos)
    world.backend.init_forward_metadata(batch)
    num_tokens = bs * draft_token_num
    layer = world.layer(0)
    q, q64 = world.random_q(num_tokens)
    k, _ = world.random_q(num_tokens, world.num_kv_heads, world.head_dim)
    v, _ = world.random_q(num_tokens, world.num_kv_heads, world.v_head_dim)
    out = world.backend.forward(q, k, v, layer, batch, out=world.poisoned_out(num_tokens))

    expected = np.empty((num_tokens, world.num_q_heads, world.v_head_dim))
    for r, p in enumerate(prefix_lens):
        rows = slice(r * draft_token_num, (r + 1) * draft_token_num)
        kv_k, kv_v = world.kv(0, world.token_slots[r][:p + draft_token_num])
        visible = masks[r].astype(bool)
        if window >= 0:
            kv_pos = np.concatenate([np.arange(p), positions[r]])
            visible &= kv_pos[None, :] >= positions[r][:, None] - window
        expected[rows] = attention(q64[rows], kv_k, kv_v, layer.scaling, 0.0, visible)
    assert_close(world.out_f64(out), expected, world.q_dtype, "TARGET_VERIFY")


def test_target_verify_tree_mask():
    rng = make_rng(50)
    world = World(rng, page_size=4)
    verify_step(world, [1, 9, 26], 5, rng=rng)


def test_target_verify_with_window_uses_positions():
    rng = make_rng(51)
    world = World(rng, page_size=1, window=4)
    verify_step(world, [3, 17], 6, window=4, rng=rng)


# ---- IDLE --------------------------------------------------------------------------------------

def test_idle_returns_empty_output():
    world = World(make_rng(60))
    batch = kvattn.ForwardBatch("IDLE", 0, req_to_token_pool=world.pool, kv_cache=world.cache)
    world.backend.init_forward_metadata(batch)
    q = np.zeros((0, world.num_q_heads, world.head_dim), np.float32)
    out = world.backend.forward(q, None, None, world.layer(0), batch)
    assert out.shape == (0, world.num_q_heads * world.v_head_dim)
    assert out.dtype == np.float32


# ---- encoder-decoder (cross-attention) --------------------------------------------------------

def test_cross_attention_decode_and_extend():
    world = World(make_rng(70), num_layers=2, encoder_decoder=True, page_size=2)
    encoder_lens = [5, 0, 12]
    prefix_lens = [3, 4, 0]
    extend_lens = [2, 1, 6]
    bs = len(encoder_lens)
    new_slots = []
    for r in range(bs):
        world.fill(world.add_tokens(r, encoder_lens[r]))  # encoder tokens sit first
        if prefix_lens[r]:
            world.fill(world.add_tokens(r, prefix_lens[r]))
        new_slots.append(world.add_tokens(r, extend_lens[r]))
    loc = np.concatenate(new_slots).astype(np.int32)
    enc = np.asarray(encoder_lens, np.int32)
    prefix = np.asarray(prefix_lens, np.int32)
    extend = np.asarray(extend_lens, np.int32)
    batch = world.batch("EXTEND", list(range(bs)), prefix + extend, out_cache_loc=loc,
                        extend_prefix_lens=prefix, extend_prefix_lens_cpu=prefix,
                        extend_seq_lens=extend, extend_seq_lens_cpu=extend, encoder_lens=enc,
                        encoder_lens_cpu=enc)
    world.backend.init_forward_metadata(batch)
    n = int(extend.sum())
    self_layer = world.layer(0)
    cross_layer = world.layer(1, is_cross_attention=True)
    q, q64 = world.random_q(n)
    k, _ = world.random_q(n, world.num_kv_heads, world.head_dim)
    v, _ = world.random_q(n, world.num_kv_heads, world.v_head_dim)
    out_self = world.backend.forward(q, k, v, self_layer, batch, out=world.poisoned_out(n))
    out_cross = world.backend.forward(q, None, None, cross_layer, batch, save_kv_cache=False,
                                      out=world.poisoned_out(n))
    expected_self = np.empty((n, world.num_q_heads, world.v_head_dim))
    expected_cross = np.empty_like(expected_self)
    row = 0
    for r in range(bs):
        e_len, p, e = encoder_lens[r], prefix_lens[r], extend_lens[r]
        rows = slice(row, row + e)
        slots = world.token_slots[r]
        dk, dv = world.kv(0, slots[e_len:e_len + p + e])
        expected_self[rows] = attention(q64[rows], dk, dv, self_layer.scaling, 0.0,
                                        causal_visible(np.arange(p, p + e), np.arange(p + e)))
        ek, ev = world.kv(1, slots[:e_len])
        expected_cross[rows] = attention(q64[rows], ek, ev, cross_layer.scaling, 0.0,
                                         np.ones((e, e_len), bool))
        row += e
    assert_close(world.out_f64(out_self), expected_self, "fp32", "decoder self-attention")
    assert_close(world.out_f64(out_cross), expected_cross, "fp32", "cross-attention")


# ---- multi-step draft --------------------------------------------------------------------------

@pytest.mark.parametrize("topk,num_steps", [(1, 3), (2, 3)])
def test_multi_step_draft(topk, num_steps):
    world = World(make_rng(80 + topk), page_size=1, backend=False)
    draft = kvattn.MultiStepDraftBackend("cpu", world.backend_config, topk, num_steps)
    assert (draft.topk, draft.num_steps) == (topk, num_steps)
    seq_lens = [1, 7, 18]
    bs = len(seq_lens)
    for r, s in enumerate(seq_lens):
        world.fill(world.add_tokens(r, s))
        world.add_tokens(r, topk * num_steps)  # where the draft tokens go
    batch = world.batch("DECODE", list(range(bs)), seq_lens, topk=topk, num_steps=num_steps)
    draft.init_forward_metadata(batch)
    layer = world.layer(0)
    rows = bs * topk
    for step in range(num_steps):
        loc = np.array([world.token_slots[r][seq_lens[r] + step * topk + b]
                        for r in range(bs) for b in range(topk)], np.int32)
        q, q64 = world.random_q(rows)
        k, _ = world.random_q(rows, world.num_kv_heads, world.head_dim)
        v, _ = world.random_q(rows, world.num_kv_heads, world.v_head_dim)
        out = draft.forward_step(step, q, k, v, layer, loc, out=world.poisoned_out(rows))
        expected = np.empty((rows, world.num_q_heads, world.v_head_dim))
        for r in range(bs):
            for b in range(topk):
                row = r * topk + b
                positions = list(range(seq_lens[r])) + [seq_lens[r] + t * topk + b
                                                        for t in range(step + 1)]
                kk, vv = world.kv(0, [world.token_slots[r][p] for p in positions])
                expected[row] = attention(q64[row:row + 1], kk, vv, layer.scaling, 0.0,
                                          np.ones((1, len(positions)), bool))[0]
        assert_close(world.out_f64(out), expected, "fp32", f"draft step {step}")


# ---- the hooks a CPU backend answers -----------------------------------------------------------

def test_cuda_graph_and_speculative_hooks_on_cpu():
    world = World(make_rng(90))
    backend = world.backend
    assert backend.kind == kvattn.BackendKind.cpu
    assert backend.device == "cpu"
    backend.init_cuda_graph_state(8, 64)  # a no-op on the CPU
    assert isinstance(backend.get_cuda_graph_seq_len_fill_value(), int)
    backend.on_after_cuda_graph_warmup()
    buffers = backend.get_verify_buffers_to_fill_after_draft()
    assert len(buffers) == 2
    batch = extend_step(world, "DECODE", [4], [1])
    backend.update_verify_buffers_to_fill_after_draft(batch, 0)
    assert backend.supports_indexer_metadata() is False
    with pytest.raises(NotImplementedError, match="breakable"):
        backend.init_forward_metadata_for_breakable_cuda_graph_capture(batch)
    with pytest.raises(NotImplementedError):
        backend.prepare_forward_metadata_for_breakable_cuda_graph_replay(batch)


def test_out_graph_then_in_graph_equals_init_forward_metadata():
    world = World(make_rng(91), page_size=4)
    for r, p in enumerate([5, 11]):
        world.fill(world.add_tokens(r, p))
        world.add_tokens(r, 1)
    loc = np.array([world.token_slots[0][-1], world.token_slots[1][-1]], np.int32)
    batch = world.batch("DECODE", [0, 1], [6, 12], out_cache_loc=loc)
    layer = world.layer(0)
    q, _ = world.random_q(2)
    world.backend.init_forward_metadata(batch)
    first = world.backend.forward(q, None, None, layer, batch, save_kv_cache=False)
    world.backend.init_forward_metadata_out_graph(batch, in_capture=False)
    world.backend.init_forward_metadata_in_graph(batch)
    second = world.backend.forward(q, None, None, layer, batch, save_kv_cache=False)
    np.testing.assert_array_equal(first, second)
