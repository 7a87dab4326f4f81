"""Tensors cross without copies, both ways: kvattn works in the engine's own buffers, and the
arrays kvattn hands out are views of its memory."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import kvattn
from attention_reference import World, assert_close, attention, encode


def address(array) -> int:
    return array.__array_interface__["data"][0]


def test_engine_writes_are_seen_by_the_cache_and_by_forward():
    world = World(np.random.default_rng(1), page_size=4)
    slots = world.add_tokens(0, 5)
    world.fill(slots)
    world.add_tokens(0, 1)
    new_slot = world.token_slots[0][-1]

    # the cache's K view of layer 0 is the engine's array itself
    k_view = np.from_dlpack(world.cache.k_buffer(0))
    assert address(k_view) == address(world.k[0])
    assert k_view.shape == world.k[0].shape and k_view.dtype == np.float16

    # a write through the engine-owned buffer is in the KV cache at once
    world.k[0][slots[2], 1, 3] = np.float16(7.5)
    assert np.from_dlpack(world.cache.k_buffer(0))[slots[2], 1, 3] == np.float16(7.5)

    batch = world.batch("DECODE", [0], [6], out_cache_loc=np.array([new_slot], np.int32))
    world.backend.init_forward_metadata(batch)
    layer = world.layer(0)
    q, q64 = world.random_q(1)
    k, k64 = world.random_q(1, world.num_kv_heads, world.head_dim)
    v, v64 = world.random_q(1, world.num_kv_heads, world.v_head_dim)

    # forward saves the new token's K/V straight into the engine's arrays
    world.backend.forward(q, k, v, layer, batch)
    np.testing.assert_array_equal(world.k[0][new_slot], encode(k64[0], "fp16"))
    np.testing.assert_array_equal(world.v[0][new_slot], encode(v64[0], "fp16"))

    # change every cached value through the engine's arrays: forward reads the new ones
    def run_and_check():
        out = world.backend.forward(q, None, None, layer, batch, save_kv_cache=False)
        kk, vv = world.kv(0, world.token_slots[0])
        expected = attention(q64, kk, vv, layer.scaling, 0.0, np.ones((1, 6), bool))
        assert_close(world.out_f64(out), expected, "fp32")
        return out

    before = run_and_check()
    world.v[0][world.token_slots[0]] *= np.float16(-2)
    after = run_and_check()
    assert not np.allclose(before, after)


def test_req_to_token_pool_wraps_the_engine_table():
    table = np.zeros((4, 16), np.int32)
    pool = kvattn.ReqToTokenPool.wrap(table)
    assert (pool.max_reqs, pool.max_context_len) == (4, 16)
    table[2, :3] = [9, 8, 7]
    np.testing.assert_array_equal(pool.read(2, 0, 3), [9, 8, 7])
    pool.write(1, 4, np.array([5, 6], np.int32))
    np.testing.assert_array_equal(table[1, 4:6], [5, 6])
    assert address(np.from_dlpack(pool.table)) == address(table)


def test_output_is_written_in_place():
    world = World(np.random.default_rng(2))
    world.fill(world.add_tokens(0, 4))
    batch = world.batch("DECODE", [0], [4],
                        out_cache_loc=np.array([world.token_slots[0][-1]], np.int32))
    world.backend.init_forward_metadata(batch)
    out = world.poisoned_out(1)
    q, _ = world.random_q(1)
    returned = world.backend.forward(q, None, None, world.layer(), batch, save_kv_cache=False,
                                     out=out)
    assert returned is out and np.isfinite(out).all()
    # a strided view of a bigger buffer works too: only its rows are written
    big = np.full((3, out.shape[1] * 2), np.nan, np.float32)
    view = big[1:2, : out.shape[1]]
    world.backend.forward(q, None, None, world.layer(), batch, save_kv_cache=False, out=view)
    np.testing.assert_array_equal(view, out)
    assert np.isnan(big[0]).all() and np.isnan(big[2]).all()
    assert np.isnan(big[1, out.shape[1]:]).all()


def test_batch_keeps_what_it_is_given():
    seq = np.array([4, 5], np.int32)
    batch = kvattn.ForwardBatch("DECODE", 2, seq_lens=seq, extend_seq_lens_cpu=[1, 2])
    assert batch.seq_lens is seq
    # lists become int32 arrays that the batch owns
    np.testing.assert_array_equal(batch.extend_seq_lens_cpu, [1, 2])
    del seq
    gc.collect()
    np.testing.assert_array_equal(batch.seq_lens, [4, 5])
    batch.seq_lens = None
    assert batch.seq_lens is None


def test_allocated_cache_views_outlive_the_cache_object():
    config = kvattn.KvCacheConfig(num_layers=2, num_slots=32, num_kv_heads=1, head_dim=8,
                                  page_size=4, dtype="bf16")
    cache = kvattn.KvCache.allocate(config)
    bits = np.from_dlpack(cache.v_buffer(1, as_bits=True))
    assert bits.dtype == np.uint16 and bits.shape == (32, 1, 8)
    assert not bits.any()  # allocate zero-fills
    bits[3, 0, 2] = 0x3F80  # 1.0 in bf16
    assert np.from_dlpack(cache.v_buffer(1, as_bits=True))[3, 0, 2] == 0x3F80
    del cache
    gc.collect()
    assert bits[3, 0, 2] == 0x3F80  # the view keeps the pool's memory alive


def test_ml_dtypes_arrays_cross_as_their_bits():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    world = World(np.random.default_rng(3), q_dtype="bf16", kv_dtype="bf16", backend=False)
    k_pool = [b.view(ml_dtypes.bfloat16) for b in world.k]
    v_pool = [b.view(ml_dtypes.bfloat16) for b in world.v]
    cache = kvattn.KvCache.wrap(world.config, k_pool, v_pool)
    assert address(np.from_dlpack(cache.k_buffer(0, as_bits=True))) == address(world.k[0])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        kvattn.KvCache.wrap(world.config, [np.zeros((4, 2, 16), ml_dtypes.float8_e4m3fn)],
                            v_pool)
    backend = kvattn.make_backend("cpu", kvattn.BackendConfig(
        kv_cache=cache, req_to_token_pool=world.pool, num_q_heads=world.num_q_heads,
        num_kv_heads=world.num_kv_heads, head_dim=world.head_dim, q_dtype="bf16"))
    world.fill(world.add_tokens(0, 6))
    batch = world.batch("DECODE", [0], [6], out_cache_loc=np.array([world.token_slots[0][-1]],
                                                                   np.int32))
    batch.kv_cache = cache
    backend.init_forward_metadata(batch)
    q_bits, q64 = world.random_q(1)
    out = backend.forward(q_bits.view(ml_dtypes.bfloat16), None, None, world.layer(), batch,
                          save_kv_cache=False)
    assert out.dtype == ml_dtypes.bfloat16
    kk, vv = world.kv(0, world.token_slots[0])
    expected = attention(q64, kk, vv, world.head_dim ** -0.5, 0.0, np.ones((1, 6), bool))
    assert_close(world.out_f64(out.view(np.uint16)), expected, "bf16")
