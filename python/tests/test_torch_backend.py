"""kvattn.torch_backend.KvattnAttnBackend over SGLang-shaped objects with torch CPU tensors:
the call pattern of the reference AttentionBackend, the field mapping, every mode (against
torch SDPA on gathered KV). Skipped where torch is not installed (CI installs it and sets
KVATTN_REQUIRE_TORCH=1, so there it always runs)."""

from __future__ import annotations

import os
import runpy
import types
from pathlib import Path

import numpy as np
import pytest

# CI installs torch and sets KVATTN_REQUIRE_TORCH=1: there a missing torch fails instead of
# skipping every test of the class engines use.
if os.environ.get("KVATTN_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip("torch")

import kvattn  # noqa: E402
from kvattn.torch_backend import (KvattnAttnBackend, describe_layer,  # noqa: E402
                                  forward_mode_of, measure_forward_overhead_us)
from torch_scenarios import (Engine, ForwardMode, TokenToKVPool, decode_step,  # noqa: E402
                             extend_like_step, multi_step_draft, radix_attention,
                             shared_prefix_decode_step, shared_prefix_requests, verify_step)


def engine(**options):
    fields = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, q_dtype=torch.float32,
                  size=1024, max_reqs=8, max_context_len=512)
    fields.update(options)
    return Engine("cpu", **fields)


@pytest.mark.parametrize("page_size", [1, 4])
def test_decode(page_size):
    decode_step(engine(page_size=page_size), [0, 5, 33])


def test_extend_mixed_draft_extend():
    extend_like_step(engine(page_size=4), ForwardMode.EXTEND, [0, 6, 20], [3, 9, 1])
    extend_like_step(engine(), ForwardMode.MIXED, [0, 12], [5, 1])
    extend_like_step(engine(), ForwardMode.DRAFT_EXTEND, [7], [3])
    extend_like_step(engine(ragged_extend_threshold=0), ForwardMode.EXTEND, [4, 0], [6, 5],
                     ragged=True)


def test_window_and_v_head_dim():
    e = engine(window=3, v_head_dim=8)
    extend_like_step(e, ForwardMode.EXTEND, [0, 10], [7, 2])


def test_target_verify():
    verify_step(engine(page_size=2), [3, 11], 4)


@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16])
def test_attention_sinks_every_mode(sink_dtype):
    """forward(..., sinks=) as gpt-oss passes them: one logit per q head joins every softmax."""
    sinks = (torch.linspace(-1.0, 4.0, 4) + 0.3).to(sink_dtype)  # num_q_heads = 4
    decode_step(engine(page_size=4), [0, 5, 33], sinks=sinks)
    extend_like_step(engine(), ForwardMode.EXTEND, [0, 6, 20], [3, 9, 1], sinks=sinks)
    extend_like_step(engine(ragged_extend_threshold=0), ForwardMode.EXTEND, [4, 0], [6, 5],
                     ragged=True, sinks=sinks)
    extend_like_step(engine(window=3), ForwardMode.MIXED, [0, 12], [5, 1], sinks=sinks)
    extend_like_step(engine(), ForwardMode.DRAFT_EXTEND, [7], [3], sinks=sinks)
    verify_step(engine(page_size=2), [3, 11], 4, sinks=sinks)
    multi_step_draft(engine(), [2, 9], topk=2, num_steps=2, sinks=sinks)


def test_attention_sinks_are_checked():
    with pytest.raises(kvattn.InvalidArgumentError, match="sinks"):
        decode_step(engine(), [5], sinks=torch.zeros(3))  # 4 q heads
    with pytest.raises(kvattn.InvalidArgumentError, match="sinks"):
        decode_step(engine(), [5], sinks=torch.zeros(4, dtype=torch.int32))


def test_multi_step_draft():
    multi_step_draft(engine(), [2, 9], topk=2, num_steps=2)


def test_fp8_pool_stored_as_uint8():
    e = engine(kv_dtype=torch.float8_e4m3fn, q_dtype=torch.float16, fp8_scale=0.5)
    assert e.token_to_kv_pool.k_buffer[0].dtype == torch.uint8
    assert e.backend.kv_cache.config.dtype == kvattn.DType.fp8_e4m3
    decode_step(e, [4, 17])


def test_idle_and_dispatch():
    e = engine()
    fb = e.batch(ForwardMode.IDLE, [], [])
    e.backend.init_forward_metadata(fb)
    q = torch.zeros(0, 4 * 16)
    out = e.backend.forward(q, None, None, e.layer(), fb)
    assert out.shape == (0, 4 * 16)
    assert forward_mode_of(ForwardMode.TARGET_VERIFY) == kvattn.ForwardMode.TARGET_VERIFY
    assert forward_mode_of(ForwardMode.MIXED) == kvattn.ForwardMode.MIXED
    assert forward_mode_of("decode") == kvattn.ForwardMode.DECODE


def test_reference_hooks():
    e = engine()
    b = e.backend
    b.init_cuda_graph_state(4, 64)
    assert isinstance(b.get_cuda_graph_seq_len_fill_value(), int)
    b.on_after_cuda_graph_warmup()
    assert len(b.get_verify_buffers_to_fill_after_draft()) == 2
    b.update_verify_buffers_to_fill_after_draft(None, None)
    assert b.get_indexer_metadata(0, None) is None
    assert b.support_triton() is True
    fb = e.batch(ForwardMode.DECODE, [0], [1], out_cache_loc=e.add_tokens(0, 1))
    with pytest.raises(NotImplementedError):
        b.init_forward_metadata_for_breakable_cuda_graph_capture(fb)
    with pytest.raises(NotImplementedError):
        b.prepare_forward_metadata_for_breakable_cuda_graph_replay(None, fb)
    b.init_forward_metadata(fb)
    q = torch.randn(1, 64)
    # An argument kvattn does not know is refused by name (sinks are known: see below).
    with pytest.raises(NotImplementedError, match="attention_chunk"):
        b.forward(q, torch.randn(1, 2, 16), torch.randn(1, 2, 16), e.layer(), fb,
                  attention_chunk=torch.zeros(4))


def test_out_graph_in_graph_split_matches_eager():
    e = engine(page_size=4)
    e.fill(e.add_tokens(0, 9))
    fb = e.batch(ForwardMode.DECODE, [0], [10], out_cache_loc=e.add_tokens(0, 1))
    e.fill(fb.out_cache_loc)
    q = torch.randn(1, 64)
    layer = e.layer()
    e.backend.init_forward_metadata_out_graph(fb, in_capture=True)
    e.backend.init_forward_metadata_in_graph(fb)
    first = e.backend.forward(q, None, None, layer, fb, save_kv_cache=False)
    e.backend.init_forward_metadata(fb)
    second = e.backend.forward(q, None, None, layer, fb, save_kv_cache=False)
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def test_layer_mapping():
    layer = radix_attention(5, 8, 2, 64, 32, logit_cap=30.0, sliding_window_size=None,
                            k_scale=torch.tensor(0.25), v_scale=2.0)
    native = describe_layer(layer, start_layer=4)
    assert (native.layer_id, native.num_q_heads, native.num_kv_heads) == (1, 8, 2)
    assert (native.head_dim, native.v_head_dim) == (64, 32)
    assert native.logit_cap == pytest.approx(30.0)
    assert native.sliding_window_size == -1
    assert (native.k_scale, native.v_scale) == (0.25, 2.0)


def test_pool_with_get_kv_buffer_only_and_start_layer():
    full = TokenToKVPool(64, 4, torch.bfloat16, 2, 16, 16, 2, torch.device("cpu"),
                         start_layer=10)

    class Pool:  # only the accessor, as some engines' pools expose
        page_size = 4
        dtype = torch.bfloat16
        layer_num = 2
        start_layer = 10

        def get_kv_buffer(self, layer_id):
            return full.get_kv_buffer(layer_id)

    req_pool = types.SimpleNamespace(req_to_token=torch.zeros((4, 32), dtype=torch.int32))
    backend = KvattnAttnBackend(Pool(), req_pool, num_q_heads=4, q_dtype=torch.float32)
    assert backend.kv_cache.num_layers == 2
    assert backend.kv_cache.num_slots == 68
    k1 = torch.from_dlpack(backend.kv_cache.k_buffer(1))
    assert k1.data_ptr() == full.k_buffer[1].data_ptr()


def test_from_model_runner():
    e = engine()
    runner = types.SimpleNamespace(
        token_to_kv_pool=e.token_to_kv_pool, req_to_token_pool=e.req_to_token_pool,
        dtype=torch.float32, sliding_window_size=None, tp_size=2,
        model_config=types.SimpleNamespace(num_attention_heads=8, head_dim=16,
                                           get_num_kv_heads=lambda tp: 4 // tp,
                                           is_encoder_decoder=False))
    backend = KvattnAttnBackend.from_model_runner(runner)
    assert backend.config.num_q_heads == 4 and backend.config.num_kv_heads == 2
    assert not backend.config.deterministic
    # SGLang's --enable-deterministic-inference turns on batch invariance.
    runner.server_args = types.SimpleNamespace(enable_deterministic_inference=True)
    assert KvattnAttnBackend.from_model_runner(runner).config.deterministic


def test_overhead_measurement_runs():
    e = engine()
    e.fill(e.add_tokens(0, 8))
    fb = e.batch(ForwardMode.DECODE, [0], [9], out_cache_loc=e.add_tokens(0, 1))
    e.backend.init_forward_metadata(fb)
    q = torch.randn(1, 64)
    k = torch.randn(1, 2, 16)
    result = measure_forward_overhead_us(e.backend, q, k, k.clone(), e.layer(), fb,
                                         iterations=50, repeats=3)
    assert result["python_us"] > 0 and result["native_us"] > 0
    print(f"\nCPU torch forward: {result}")


def test_quickstart_example_runs(capsys):
    runpy.run_path(str(Path(__file__).parents[1] / "examples" / "torch_quickstart.py"))
    assert "torch.Size([100, 4096])" in capsys.readouterr().out


@pytest.mark.parametrize("allocation", ["torch", "dlpack"])
def test_forward_output_like_new_empty_and_written(allocation):
    """forward's output (q.new_empty, or torch's allocator called through DLPack's C exchange
    API) is a contiguous tensor of q's dtype and device, and every element is written."""
    e = engine(output_allocation=allocation)
    e.fill(e.add_tokens(0, 8))
    fb = e.batch(ForwardMode.DECODE, [0], [9], out_cache_loc=e.add_tokens(0, 1))
    e.fill(fb.out_cache_loc)
    e.backend.init_forward_metadata(fb)
    layer = e.layer()
    q = torch.randn(1, 64)
    out = e.backend.forward(q, None, None, layer, fb, save_kv_cache=False)
    reference = torch.full((1, 64), float("nan"))
    e.backend.native.forward_decode(q, None, None, reference, describe_layer(layer),
                                    e.backend._batch, False)
    assert type(out) is torch.Tensor and out.is_contiguous()
    assert (out.shape, out.dtype, out.device) == ((1, 64), q.dtype, q.device)
    assert torch.isfinite(reference).all()
    torch.testing.assert_close(out, reference, rtol=0, atol=0)
    out.add_(1.0)
    assert out.view(1, 4, 16).sum().isfinite()
    if allocation == "torch":  # an ordinary tensor, as the engine would allocate itself
        assert out.untyped_storage().resizable()


def test_output_allocation_is_checked():
    with pytest.raises(ValueError, match="output_allocation"):
        engine(output_allocation="numpy")


def test_forward_reads_strided_q_and_kv_views():
    """q and k/v crossing without a capsule keep their strides: a column slice of a wider
    tensor gives the same result as its contiguous copy."""
    e = engine()
    e.fill(e.add_tokens(0, 5))
    slot = e.add_tokens(0, 1)
    fb = e.batch(ForwardMode.DECODE, [0], [6], out_cache_loc=slot)
    e.backend.init_forward_metadata(fb)
    layer = e.layer()
    wide = torch.randn(1, 4, 32)
    q = wide[:, :, 8:24]  # [1, 4, 16] with head stride 32
    kv = torch.randn(1, 2, 2, 16)
    k, v = kv[:, :, 0], kv[:, :, 1]  # strided [1, 2, 16] views
    strided = e.backend.forward(q, k, v, layer, fb)
    dense = e.backend.forward(q.contiguous(), k.contiguous(), v.contiguous(), layer, fb)
    torch.testing.assert_close(strided, dense, rtol=0, atol=0)
    assert torch.isfinite(dense).all()
    assert not torch.equal(dense, e.backend.forward(wide[:, :, :16].contiguous(), k, v, layer, fb))


def test_forward_bad_tensors_raise_with_the_argument_name():
    e = engine()
    fb = e.batch(ForwardMode.DECODE, [0], [1], out_cache_loc=e.add_tokens(0, 1))
    e.backend.init_forward_metadata(fb)
    layer = e.layer()
    with pytest.raises(ValueError, match="q") as info:
        e.backend.forward(torch.zeros(1, 64, dtype=torch.float64), None, None, layer, fb)
    assert info.value.argument == "q"
    with pytest.raises(ValueError, match="k"):
        e.backend.forward(torch.zeros(1, 64), torch.zeros(1, 2, 16, dtype=torch.int16),
                          torch.zeros(1, 2, 16), layer, fb)
    with pytest.raises(TypeError, match="q: expected an array"):
        e.backend.native.forward_decode("not an array", None, None, None, describe_layer(layer),
                                        e.backend._batch, False)
    with pytest.raises(ValueError, match="out"):
        e.backend.native.forward_decode(torch.zeros(1, 64), None, None, torch.zeros(1, 65),
                                        describe_layer(layer), e.backend._batch, False)


def test_native_forward_returns_the_out_it_was_given():
    e = engine()
    fb = e.batch(ForwardMode.DECODE, [0], [1], out_cache_loc=e.add_tokens(0, 1))
    e.backend.init_forward_metadata(fb)
    out = torch.full((1, 64), float("nan"))
    k = torch.randn(1, 2, 16)
    result = e.backend.native.forward_decode(torch.randn(1, 64), k, k.clone(), out,
                                             describe_layer(e.layer()), e.backend._batch, True)
    assert result is out and torch.isfinite(out).all()


@pytest.mark.skipif(not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"),
                    reason="torch without DLPack's C exchange API")
def test_torch_tensors_take_the_c_exchange_path():
    assert kvattn._kvattn._has_exchange_api(torch.empty(0))
    assert not kvattn._kvattn._has_exchange_api(np.empty(0))
    e = engine()
    e.fill(e.add_tokens(0, 3))
    fb = e.batch(ForwardMode.DECODE, [0], [4], out_cache_loc=e.add_tokens(0, 1))
    e.backend.init_forward_metadata(fb)
    q, k = torch.randn(1, 64), torch.randn(1, 2, 16)
    result = measure_forward_overhead_us(e.backend, q, k, k.clone(), e.layer(), fb,
                                         iterations=20, repeats=3, warmup=1)
    assert result["native_allocates"] is True
    assert result["native_us"] > 0 and result["native_preallocated_us"] > 0


def test_declared_shared_prefix_groups():
    """Shared-prefix groups as attributes of the engine's forward batch (DECODE): requests 0, 2
    and 3 share a 36-token prompt (declared as 35 shared keys, group 0), 1 and 4 have their own
    rows. The output is each request's plain attention; a member whose row breaks the promise
    refuses the step, naming shared_prefix_lens_cpu[0], and writes nothing."""
    e = engine(page_size=4)
    shared_prefix_requests(e, 36, [5, 40, 1, 17, 60], members=(0, 2, 3))
    groups = dict(shared_prefix_group_cpu=[0, -1, 0, 0, -1], shared_prefix_lens_cpu=[35])
    shared_prefix_decode_step(e, 5, **groups)
    shared_prefix_decode_step(e, 5)  # no groups (the CPU backend then looks for them itself)

    # Request 3 now holds another slot at shared position 20: the promise is broken.
    e.req_to_token_pool.req_to_token[3, 20] = e.token_slots[1][0]
    k_before = [k.clone() for k in e.token_to_kv_pool.k_buffer]
    with pytest.raises(kvattn.InvalidArgumentError, match=r"shared_prefix_lens_cpu\[0\]"):
        shared_prefix_decode_step(e, 5, check=False, **groups)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # bytes: NaN != NaN
               for a, b in zip(k_before, e.token_to_kv_pool.k_buffer))
    # A group of one member is refused by the lengths' validation.
    fb = e.batch(ForwardMode.DECODE, [0, 1], [len(e.token_slots[0]), len(e.token_slots[1])],
                 shared_prefix_group_cpu=[0, -1], shared_prefix_lens_cpu=[3])
    with pytest.raises(kvattn.InvalidArgumentError, match="expected >= 2"):
        e.backend.init_forward_metadata(fb)
