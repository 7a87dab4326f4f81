"""Bad input becomes a Python exception carrying the library's message, and never corrupts the
KV pool."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

import kvattn
from attention_reference import World


@pytest.fixture
def world():
    w = World(np.random.default_rng(5), page_size=4)
    for r, p in enumerate([6, 9]):
        w.fill(w.add_tokens(r, p))
        w.add_tokens(r, 1)
    return w


def decode_batch(world, **overrides):
    loc = np.array([world.token_slots[0][-1], world.token_slots[1][-1]], np.int32)
    fields = dict(out_cache_loc=loc)
    fields.update(overrides)
    return world.batch("DECODE", [0, 1], [7, 10], **fields)


def decode_inputs(world):
    q, _ = world.random_q(2)
    k, _ = world.random_q(2, world.num_kv_heads, world.head_dim)
    v, _ = world.random_q(2, world.num_kv_heads, world.v_head_dim)
    return q, k, v


def pool_snapshot(world):
    return [k.copy() for k in world.k] + [v.copy() for v in world.v]


def assert_pool_unchanged(world, snapshot):
    for before, after in zip(snapshot, world.k + world.v):
        np.testing.assert_array_equal(before.view(np.uint8), after.view(np.uint8))


def test_error_hierarchy():
    assert issubclass(kvattn.InvalidArgumentError, kvattn.Error)
    assert issubclass(kvattn.InvalidArgumentError, ValueError)
    assert issubclass(kvattn.NotSupportedError, NotImplementedError)
    assert issubclass(kvattn.OutOfResourcesError, MemoryError)
    assert issubclass(kvattn.DeviceError, RuntimeError)


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="page_size") as info:
        kvattn.KvCacheConfig(num_slots=12, num_kv_heads=1, head_dim=8, page_size=3).validate()
    assert info.value.argument == "page_size"
    assert str(info.value).startswith("kvattn: page_size")


def test_wrong_q_dtype(world):
    batch = decode_batch(world)
    world.backend.init_forward_metadata(batch)
    q, k, v = decode_inputs(world)
    with pytest.raises(ValueError, match="float64 is not supported"):
        world.backend.forward(q.astype(np.float64), k, v, world.layer(), batch)
    with pytest.raises(ValueError, match="int8 is not supported"):
        world.backend.forward(q.astype(np.int8), k, v, world.layer(), batch)


def test_wrong_output_shape_leaves_pool_unchanged(world):
    batch = decode_batch(world)
    world.backend.init_forward_metadata(batch)
    q, k, v = decode_inputs(world)
    snapshot = pool_snapshot(world)
    bad_out = np.empty((2, world.num_q_heads * world.v_head_dim + 1), np.float32)
    with pytest.raises(ValueError, match="out"):
        world.backend.forward(q, k, v, world.layer(), batch, out=bad_out)
    assert_pool_unchanged(world, snapshot)


def test_out_of_range_slot_never_written(world):
    loc = np.array([world.token_slots[0][-1], world.config.num_slots + 3], np.int32)
    batch = decode_batch(world, out_cache_loc=loc)
    q, k, v = decode_inputs(world)
    snapshot = pool_snapshot(world)
    with pytest.raises(ValueError, match="out_cache_loc"):
        world.backend.init_forward_metadata(batch)
        world.backend.forward(q, k, v, world.layer(), batch)
    assert_pool_unchanged(world, snapshot)


def test_req_pool_index_out_of_range(world):
    batch = world.batch("DECODE", [0, 99], [7, 10],
                        out_cache_loc=np.array([1, 2], np.int32))
    with pytest.raises(ValueError, match="req_pool_indices"):
        world.backend.init_forward_metadata(batch)


def test_prefix_longer_than_sequence(world):
    prefix = np.array([8, 1], np.int32)
    extend = np.array([1, 1], np.int32)
    batch = world.batch("EXTEND", [0, 1], [7, 10], out_cache_loc=np.array([1, 2], np.int32),
                        extend_prefix_lens=prefix, extend_prefix_lens_cpu=prefix,
                        extend_seq_lens=extend, extend_seq_lens_cpu=extend)
    with pytest.raises(ValueError):
        world.backend.init_forward_metadata(batch)


def test_heads_not_divisible(world):
    batch = decode_batch(world)
    world.backend.init_forward_metadata(batch)
    q, k, v = decode_inputs(world)
    with pytest.raises(ValueError, match="head"):
        world.backend.forward(q, k, v, world.layer(num_q_heads=3), batch)


def test_forward_before_init_forward_metadata():
    w = World(np.random.default_rng(6))
    w.fill(w.add_tokens(0, 3))
    w.add_tokens(0, 1)
    batch = w.batch("DECODE", [0], [4], out_cache_loc=np.array([w.token_slots[0][-1]], np.int32))
    q, _ = w.random_q(1)
    with pytest.raises(ValueError, match="init_forward_metadata"):
        w.backend.forward(q, None, None, w.layer(), batch, save_kv_cache=False)


def test_index_tensor_of_floats(world):
    batch = decode_batch(world)
    batch.seq_lens = np.array([7.0, 10.0], np.float32)
    with pytest.raises(ValueError, match="seq_lens"):
        world.backend.init_forward_metadata(batch)


def test_wrap_rejects_mismatched_buffers():
    config = kvattn.KvCacheConfig(num_slots=16, num_kv_heads=2, head_dim=8, dtype="fp16")
    good = np.zeros((16, 2, 8), np.float16)
    with pytest.raises(ValueError, match="k_buffers"):
        kvattn.KvCache.wrap(config, [np.zeros((16, 2, 4), np.float16)], [good])
    with pytest.raises(ValueError, match="k_buffers"):
        kvattn.KvCache.wrap(config, [np.zeros((16, 2, 8), np.float32)], [good])
    with pytest.raises(ValueError):
        kvattn.KvCache.wrap(config, [np.zeros((16, 8, 2), np.float16).transpose(0, 2, 1)],
                            [good])
    with pytest.raises(ValueError):
        kvattn.KvCache.wrap(config, [good], [])  # one layer, no V


def test_wrap_bits_only_for_matching_width():
    config = kvattn.KvCacheConfig(num_slots=16, num_kv_heads=2, head_dim=8, dtype="bf16")
    bits = np.zeros((16, 2, 8), np.uint16)
    kvattn.KvCache.wrap(config, [bits], [bits.copy()])  # uint16 carries bf16 bits
    with pytest.raises(ValueError, match="uint8"):
        kvattn.KvCache.wrap(config, [np.zeros((16, 2, 8), np.uint8)], [bits])


def test_allocator_errors():
    allocator = kvattn.SlotAllocator(16, 4)  # pages 1..3 usable
    pages = allocator.allocate_pages(3)
    with pytest.raises(MemoryError) as info:
        allocator.allocate_pages(1)
    assert isinstance(info.value, kvattn.OutOfResourcesError)
    with pytest.raises(ValueError):
        allocator.free_pages([0])
    allocator.free_pages(pages)
    with pytest.raises(ValueError):
        allocator.free_pages([int(pages[0])])  # not in use any more
    with pytest.raises(ValueError, match="pages"):
        allocator.free_pages("not pages")


def test_req_to_token_pool_errors():
    pool = kvattn.ReqToTokenPool.allocate(2, 8)
    with pytest.raises(ValueError):
        pool.write(2, 0, [1])
    with pytest.raises(ValueError):
        pool.write(0, 6, [1, 2, 3])
    with pytest.raises(ValueError):
        kvattn.ReqToTokenPool.wrap(np.zeros((2, 8), np.int64))


def test_bad_names():
    with pytest.raises(ValueError, match="device"):
        kvattn.KvCacheConfig(num_slots=16, num_kv_heads=1, head_dim=8, device="tpu")
    with pytest.raises(ValueError):
        kvattn.KvCacheConfig(num_slots=16, num_kv_heads=1, head_dim=8, dtype="fp64")
    with pytest.raises(ValueError, match="mode"):
        kvattn.ForwardBatch("PREFILL", 1)
    with pytest.raises(ValueError, match="not a ForwardBatch field"):
        kvattn.ForwardBatch("DECODE", 1, seq_len=np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="seq_lens"):
        kvattn.ForwardBatch("DECODE", 1, seq_lens="7")


def test_cuda_backend_without_cuda(world):
    if kvattn.cuda_compiled() and kvattn.cuda_device_count() > 0:
        pytest.skip("a CUDA device is present")
    # a build without CUDA, or a machine without a GPU: NotImplementedError either way
    with pytest.raises(NotImplementedError) as info:
        kvattn.make_backend("cuda", world.backend_config)
    assert isinstance(info.value, kvattn.NotSupportedError)


def test_draft_step_out_of_range(world):
    draft = kvattn.MultiStepDraftBackend("cpu", world.backend_config, 1, 2)
    draft.init_forward_metadata(world.batch("DECODE", [0, 1], [7, 10], topk=1, num_steps=2))
    q, k, v = decode_inputs(world)
    with pytest.raises(ValueError, match="step"):
        draft.forward_step(2, q, k, v, world.layer())


def test_gil_released_while_kernels_run():
    """Another Python thread runs while forward computes: proven by order, not by durations.

    With a switch interval far longer than the test, CPython hands the GIL to a waiting thread
    only when its holder gives it up of its own accord: blocking, exiting, or native code that
    releases it. The worker calls forward in a loop and never blocks between calls, so the main
    thread, waiting for the GIL from the moment the worker starts, can run only inside a forward
    that released it, or after the worker has finished. The main thread records which: if
    forward held the GIL, it could only run once `finished` is set. However fast or slow the
    machine, the verdict is the same (a forward too short for the main thread to wake up in is
    simply followed by another, up to 50)."""
    w = World(np.random.default_rng(7), num_q_heads=8, num_kv_heads=2, head_dim=64,
              num_slots=1 << 12, max_context_len=1 << 11, max_reqs=2)
    w.fill(w.add_tokens(0, 512))
    w.fill(w.add_tokens(0, 128))  # save_kv_cache=False below: the new K/V are in the pool
    prefix = np.array([512], np.int32)
    extend = np.array([128], np.int32)
    batch = w.batch("EXTEND", [0], [640],
                    out_cache_loc=np.asarray(w.token_slots[0][512:], np.int32),
                    extend_prefix_lens=prefix, extend_prefix_lens_cpu=prefix,
                    extend_seq_lens=extend, extend_seq_lens_cpu=extend)
    w.backend.init_forward_metadata(batch)
    q, _ = w.random_q(128)
    layer = w.layer()
    out = w.poisoned_out(128)
    observed = threading.Event()  # the main thread has run (set by it, read by the worker)
    finished = threading.Event()  # the worker is done with every forward
    calls = [0]

    def run():
        for _ in range(50):
            w.backend.forward(q, None, None, layer, batch, save_kv_cache=False, out=out)
            calls[0] += 1
            if observed.is_set():
                break
        finished.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e4)  # no forced hand-over within the test
    try:
        worker = threading.Thread(target=run)
        worker.start()  # returns once the worker gives up the GIL (see the docstring)
        ran_during_forward = not finished.is_set()
        observed.set()
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    assert ran_during_forward, (
        f"the main thread ran only after all {calls[0]} forwards: forward holds the GIL")
    assert np.isfinite(w.out_f64(out)).all()


def test_step_ids_and_check_errors_on_the_cpu(world):
    """The CPU backend refuses bad indices from the call itself; check_errors (for device-detected
    errors) has nothing to report, and every init_forward_metadata is one step."""
    backend = world.backend
    assert backend.step_id == 0
    batch = decode_batch(world)
    backend.init_forward_metadata(batch)
    backend.init_forward_metadata(batch)
    assert backend.step_id == 2
    backend.check_errors()
    assert backend.take_step_errors(synchronize=True) == []
    bad = decode_batch(world, out_cache_loc=np.array([world.token_slots[0][-1], 10**6], np.int32))
    snapshot = pool_snapshot(world)
    with pytest.raises(kvattn.InvalidArgumentError, match=r"out_cache_loc\[1\]") as info:
        backend.init_forward_metadata(bad)
    assert info.value.argument == "out_cache_loc[1]"
    assert info.value.step is None  # raised by the call, not reported by check_errors
    assert backend.step_id == 3
    assert_pool_unchanged(world, snapshot)
    backend.check_errors()
