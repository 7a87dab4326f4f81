"""Host synchronisations and device-to-host copies of a kvattn step, counted by CUPTI through
torch.profiler's trace, not assumed (issue 15: a step planned on the device makes none).

A control (a .cpu() of a CUDA tensor) first shows that the counter sees both kinds. The step
cases then count what init_forward_metadata and the layers' forward do, eager and as an engine
replays a captured DECODE step, with and without host lengths (without: planned on the device).
Skipped without CUDA."""

from __future__ import annotations

import json
import os
import tempfile
import types

import pytest

torch = pytest.importorskip("torch")

import kvattn  # noqa: E402
from kvattn.torch_backend import KvattnMultiStepDraftBackend  # noqa: E402
from torch_scenarios import Engine, ForwardMode, assert_close  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
if not kvattn.cuda_compiled():
    pytest.skip("kvattn was built without CUDA", allow_module_level=True)

LAYERS = 4


def trace_counts(fn):
    """(host synchronisations, device-to-host copies) while fn runs, from the profiler trace:
    runtime/driver calls named *Synchronize and GPU memcpy records of kind DtoH."""
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    syncs = d2h = 0
    for event in events:
        name = str(event.get("name", ""))
        category = str(event.get("cat", ""))
        if category in ("cuda_runtime", "cuda_driver") and "Synchronize" in name:
            syncs += 1
        if "Memcpy DtoH" in name or (category == "gpu_memcpy" and "DtoH" in name):
            d2h += 1
    return syncs, d2h


def net_counts(fn):
    """trace_counts of fn minus those of an empty region (what the profiler adds itself)."""
    base_syncs, base_d2h = trace_counts(lambda: None)
    syncs, d2h = trace_counts(fn)
    return syncs - base_syncs, d2h - base_d2h


def decode_world(host_lengths=True, batch=4):
    e = Engine("cuda", num_q_heads=32, num_kv_heads=8, head_dim=128, size=1 << 14, max_reqs=8,
               max_context_len=4096, num_layers=LAYERS)
    prefix = [100 + 300 * r for r in range(batch)]
    new = []
    for r, p in enumerate(prefix):
        e.fill(e.add_tokens(r, p))
        new.append(e.add_tokens(r, 1))
    seq = [p + 1 for p in prefix]
    fb = e.batch(ForwardMode.DECODE, list(range(batch)), seq, out_cache_loc=torch.cat(new))
    if not host_lengths:
        fb.seq_lens_cpu = None
    layers = [e.layer(i) for i in range(LAYERS)]
    q = e.randn(batch, 32 * 128)
    k = e.randn(batch, 8, 128)
    v = e.randn(batch, 8, 128)
    return e, fb, layers, (q, k, v)


def eager_step(e, fb, layers, qkv):
    def run():
        e.backend.init_forward_metadata(fb)
        for layer in layers:
            e.backend.forward(*qkv, layer, fb)
    return run


def capture_step(e, fb, layers, qkv, max_tokens=8, forward=None):
    """As an engine captures a bucket: graph state, out_graph(in_capture) outside, in_graph and
    every layer's forward inside (or forward(): the layers' outputs). Returns the graph and the
    layers' captured outputs."""
    e.backend.init_cuda_graph_state(8, max_tokens)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        e.backend.init_forward_metadata_out_graph(fb, in_capture=True)
        with torch.cuda.graph(graph, stream=stream):
            e.backend.init_forward_metadata_in_graph(fb)
            outs = forward() if forward else [e.backend.forward(*qkv, layer, fb) for layer in layers]
    torch.cuda.current_stream().wait_stream(stream)
    return graph, outs


def replay_without_syncs(backend, fb, graph):
    """One replay as an engine runs a step (out_graph, then the graph): no host sync, no
    device-to-host copy, and the step not refused. backend: an Engine's or a draft backend."""
    backend = getattr(backend, "backend", backend)

    def step():
        backend.init_forward_metadata_out_graph(fb)
        graph.replay()

    syncs, d2h = net_counts(step)
    torch.cuda.synchronize()
    backend.check_errors(synchronize=True)
    assert syncs == 0 and d2h == 0, (syncs, d2h)


def test_the_counter_sees_syncs_and_device_to_host_copies():
    x = torch.ones(1 << 20, device="cuda")
    syncs, d2h = net_counts(lambda: x.cpu())
    assert d2h >= 1, "a .cpu() of a CUDA tensor must show a DtoH copy"
    assert syncs + d2h >= 2, "... and its wait"


def test_decode_with_host_lengths_copies_nothing_to_the_host():
    e, fb, layers, qkv = decode_world()
    eager_step(e, fb, layers, qkv)()  # warm-up: first-call set-up may allocate
    syncs, d2h = net_counts(eager_step(e, fb, layers, qkv))
    print(f"\nkvattn-gpu-test decode with *_cpu: {syncs} syncs, {d2h} DtoH copies per step")
    assert d2h == 0


def test_decode_with_host_lengths_makes_no_host_sync():
    """The host plan's staging buffer is reused once the previous step's copy out of it ran
    (CopyFence::wait): in the steady state that copy has, and the fence makes no sync call."""
    e, fb, layers, qkv = decode_world()
    eager_step(e, fb, layers, qkv)()
    syncs, _ = net_counts(eager_step(e, fb, layers, qkv))
    assert syncs == 0


def test_decode_without_host_lengths_copies_nothing_to_the_host():
    """Issue 15: a DECODE step without seq_lens_cpu is planned on the device (no .cpu())."""
    e, fb, layers, qkv = decode_world(host_lengths=False)
    eager_step(e, fb, layers, qkv)()
    syncs, d2h = net_counts(eager_step(e, fb, layers, qkv))
    print(f"\nkvattn-gpu-test decode without *_cpu: {syncs} syncs, {d2h} DtoH copies per step")
    assert syncs == 0 and d2h == 0


def test_captured_decode_replay_copies_nothing_to_the_host():
    """As an engine runs decode: a graph captured once (in_graph + every layer's forward), then
    per step the host plan (out_graph) and a replay."""
    e, fb, layers, qkv = decode_world()
    graph, _ = capture_step(e, fb, layers, qkv)

    def step():
        e.backend.init_forward_metadata_out_graph(fb)
        graph.replay()

    step()
    syncs, d2h = net_counts(step)
    print(f"\nkvattn-gpu-test captured decode replay: {syncs} syncs, {d2h} DtoH copies per step")
    assert syncs == 0 and d2h == 0


def test_captured_decode_without_host_lengths_replays_new_lengths():
    """A DECODE graph captured without seq_lens_cpu plans each replay on the device from the
    lengths in the (same) device tensors: grown requests, replayed, equal bit for bit to an eager
    step planned from host lengths (the tensor-core plan is the host's, item for item), with no
    sync and no device-to-host copy per step."""
    e, fb, layers, qkv = decode_world(host_lengths=False)
    graph, outs = capture_step(e, fb, layers, qkv)
    # Capturing ran nothing: the captured step's new tokens were never saved (an engine's
    # capture batch is a dummy); give them K/V before later steps attend to them.
    e.fill(fb.out_cache_loc.clone())

    for grow in (37, 500, 1):
        # Every request grows: new K/V in the pool, new lengths and slots in the captured tensors.
        seq, new = [], []
        for r in range(fb.batch_size):
            if grow > 1:
                e.fill(e.add_tokens(r, grow - 1))
            slot = e.add_tokens(r, 1)
            e.fill(slot)
            new.append(slot)
            seq.append(len(e.token_slots[r]))
        fb.seq_lens.copy_(torch.tensor(seq, dtype=fb.seq_lens.dtype))
        fb.out_cache_loc.copy_(torch.cat(new))
        replay_without_syncs(e, fb, graph)
        replayed = [o.clone() for o in outs]
        host = e.batch(ForwardMode.DECODE, list(range(fb.batch_size)), seq,
                       out_cache_loc=fb.out_cache_loc.clone())
        e.backend.init_forward_metadata(host)
        for layer, got in zip(layers, replayed):
            want = e.backend.forward(*qkv, layer, host)
            assert torch.isfinite(got).all()
            assert torch.equal(got, want), f"grow {grow}: replay differs from the eager step"


def test_verify_without_host_lengths_is_planned_on_the_device():
    """Issue 15: a TARGET_VERIFY step without seq_lens_cpu makes no sync and no device-to-host
    copy, and computes the bits of the same step planned from host lengths."""
    e = Engine("cuda", num_q_heads=32, num_kv_heads=8, head_dim=128, size=1 << 14, max_reqs=8,
               max_context_len=4096, num_layers=LAYERS)
    draft = 6
    prefix = [90 + 250 * r for r in range(4)]
    masks, new = [], []
    gen = torch.Generator().manual_seed(3)
    for r, p in enumerate(prefix):
        e.fill(e.add_tokens(r, p))
        new.append(e.add_tokens(r, draft))
        tree = torch.rand(draft, draft, generator=gen) < 0.5
        tree = tree.tril() | torch.eye(draft, dtype=torch.bool)
        masks.append(torch.cat([torch.ones(draft, p, dtype=torch.bool), tree], dim=1).reshape(-1))
    spec_info = types.SimpleNamespace(custom_mask=torch.cat(masks).to("cuda"),
                                      draft_token_num=draft)
    layers = [e.layer(i) for i in range(LAYERS)]
    n = len(prefix) * draft
    q, k, v = e.randn(n, 32 * 128), e.randn(n, 8, 128), e.randn(n, 8, 128)

    def batch(host_lengths):
        fb = e.batch(ForwardMode.TARGET_VERIFY, list(range(len(prefix))), prefix,
                     out_cache_loc=torch.cat(new), spec_info=spec_info)
        if not host_lengths:
            fb.seq_lens_cpu = None
        return fb

    outs = {}
    for host_lengths in (True, False):
        fb = batch(host_lengths)
        eager_step(e, fb, layers, (q, k, v))()  # warm-up
        syncs, d2h = net_counts(eager_step(e, fb, layers, (q, k, v)))
        if not host_lengths:
            assert syncs == 0 and d2h == 0, (syncs, d2h)
        e.backend.init_forward_metadata(fb)
        outs[host_lengths] = [e.backend.forward(q, k, v, layer, fb) for layer in layers]
    e.backend.check_errors(synchronize=True)
    for a, b in zip(outs[True], outs[False]):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED,
                                  ForwardMode.DRAFT_EXTEND])
def test_extend_without_host_lengths_is_captured_and_replayed(mode):
    """Issue 15: an EXTEND-like step whose lengths are device tensors only (no *_cpu) is planned on
    the device: eager with no sync and no device-to-host copy, captured whole in a CUDA graph
    (in_graph and every layer) for its bucket of (batch size, tokens), and replayed with other
    prefixes and other splits of the tokens, each replay equal bit for bit to the eager step
    planned from host lengths."""
    e = Engine("cuda", num_q_heads=32, num_kv_heads=8, head_dim=128, size=1 << 15, max_reqs=8,
               max_context_len=4096, num_layers=LAYERS)
    bs, tokens = 3, 96
    layers = [e.layer(i) for i in range(LAYERS)]
    q, k, v = e.randn(tokens, 32 * 128), e.randn(tokens, 8, 128), e.randn(tokens, 8, 128)

    def grow(prefix_growth, new):
        """Adds cached tokens (filled) and then the step's new tokens to each request."""
        slots = []
        for r in range(bs):
            if prefix_growth[r] > 0:
                e.fill(e.add_tokens(r, prefix_growth[r]))
            slots.append(e.add_tokens(r, new[r]))
        seq = [len(e.token_slots[r]) for r in range(bs)]
        prefix = [s - n for s, n in zip(seq, new)]
        return seq, prefix, torch.cat(slots)

    def device_batch(seq, prefix, new, loc):
        dev = lambda xs: torch.tensor(xs, dtype=torch.int64, device="cuda")  # noqa: E731
        fb = e.batch(mode, list(range(bs)), seq, out_cache_loc=loc,
                     extend_prefix_lens=dev(prefix), extend_seq_lens=dev(new))
        fb.seq_lens_cpu = None
        return fb

    new = [40, 1, 55]
    seq, prefix, loc = grow([100, 700, 33], new)
    fb = device_batch(seq, prefix, new, loc)
    eager_step(e, fb, layers, (q, k, v))()  # warm-up
    syncs, d2h = net_counts(eager_step(e, fb, layers, (q, k, v)))
    print(f"\nkvattn-gpu-test {mode.name} without *_cpu: {syncs} syncs, {d2h} DtoH copies per step")
    assert syncs == 0 and d2h == 0, (syncs, d2h)

    graph, outs = capture_step(e, fb, layers, (q, k, v), max_tokens=tokens)

    for growth, split in (([5, 0, 300], [90, 3, 3]), ([0, 1, 1], [1, 94, 1]),
                          ([1000, 20, 2], [32, 32, 32])):
        seq, prefix, loc = grow(growth, split)
        fb.seq_lens.copy_(torch.tensor(seq))
        fb.extend_prefix_lens.copy_(torch.tensor(prefix))
        fb.extend_seq_lens.copy_(torch.tensor(split))
        fb.out_cache_loc.copy_(loc)
        replay_without_syncs(e, fb, graph)
        replayed = [o.clone() for o in outs]
        host = e.batch(mode, list(range(bs)), seq, out_cache_loc=loc.clone(),
                       extend_prefix_lens=fb.extend_prefix_lens.clone(),
                       extend_prefix_lens_cpu=torch.tensor(prefix),
                       extend_seq_lens=fb.extend_seq_lens.clone(),
                       extend_seq_lens_cpu=torch.tensor(split))
        e.backend.init_forward_metadata(host)
        for layer, got in zip(layers, replayed):
            want = e.backend.forward(q, k, v, layer, host)
            assert torch.isfinite(got).all()
            assert torch.equal(got, want), f"split {split}: replay differs from the eager step"


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_encoder_decoder_without_host_lengths_is_captured_and_replayed(mode):
    """Issue 15: an encoder-decoder model's step from device tensors only (seq_lens, encoder_lens,
    the extend lengths; no *_cpu) is planned on the device for both index sets (decoder self
    attention after the request's encoder tokens, cross attention over them): eager with no sync
    and no device-to-host copy, then captured whole and replayed for other requests with other
    encoder lengths and for longer sequences. Each step is compared with the eager step planned
    from host lengths: bit for bit in EXTEND (the same tiles), within bf16's bar in DECODE (the
    CUDA-core kernel's device chunks are closed-form)."""
    e = Engine("cuda", num_q_heads=32, num_kv_heads=8, head_dim=128, size=1 << 15, max_reqs=8,
               max_context_len=4096, num_layers=2, is_encoder_decoder=True)
    layers = [e.layer(0), e.layer(1, is_cross_attention=True)]
    bs = 3
    extend = mode == ForwardMode.EXTEND
    tokens = 96 if extend else bs
    q, k, v = e.randn(tokens, 32 * 128), e.randn(tokens, 8, 128), e.randn(tokens, 8, 128)
    dev = lambda xs: torch.tensor(xs, dtype=torch.int64, device="cuda")  # noqa: E731
    encoder = {}

    def grow(reqs, encoder_lens, prefix_growth, new):
        """Encoder tokens first (once a request), then cached decoder tokens, then the step's."""
        slots = []
        for r, enc, grown, n in zip(reqs, encoder_lens, prefix_growth, new):
            if r not in encoder:
                encoder[r] = enc
                if enc > 0:
                    e.fill(e.add_tokens(r, enc))
            if grown > 0:
                e.fill(e.add_tokens(r, grown))
            slots.append(e.add_tokens(r, n))
        seq = [len(e.token_slots[r]) - encoder[r] for r in reqs]  # decoder tokens only
        prefix = [s - n for s, n in zip(seq, new)]
        return seq, prefix, torch.cat(slots), [encoder[r] for r in reqs]

    def make_batch(reqs, seq, prefix, new, loc, enc, host):
        fields = dict(out_cache_loc=loc, encoder_lens=dev(enc))
        if extend:
            fields.update(extend_prefix_lens=dev(prefix), extend_seq_lens=dev(new))
        if host:
            fields.update(encoder_lens_cpu=torch.tensor(enc))
            if extend:
                fields.update(extend_prefix_lens_cpu=torch.tensor(prefix),
                              extend_seq_lens_cpu=torch.tensor(new))
        fb = e.batch(mode, list(reqs), seq, **fields)
        if not host:
            fb.seq_lens_cpu = None
        return fb

    def layer_outputs(fb):
        # (The cross layer reads the cached encoder K/V; the self layer saves the new tokens'.)
        return [e.backend.forward(q, k, v, layers[0], fb),
                e.backend.forward(q, None, None, layers[1], fb, save_kv_cache=False)]

    def step(fb):
        e.backend.init_forward_metadata(fb)
        return layer_outputs(fb)

    def expect_host_planned(got, reqs, seq, prefix, new, loc, enc):
        want = step(make_batch(reqs, seq, prefix, new, loc.clone(), enc, host=True))
        for g, w in zip(got, want):
            assert torch.isfinite(g).all()
            if extend:
                assert torch.equal(g, w), f"{enc} {seq}: differs from the host-planned step"
            else:
                assert_close(g.view(-1, 128), w.view(-1, 128), torch.bfloat16, "decode")

    first = [0, 1, 2]
    new = [40, 1, 55] if extend else [1, 1, 1]
    seq, prefix, loc, enc = grow(first, [300, 0, 17], [100, 700, 33], new)
    fb = make_batch(first, seq, prefix, new, loc, enc, host=False)
    step(fb)  # warm-up
    syncs, d2h = net_counts(lambda: step(fb))
    print(f"\nkvattn-gpu-test encoder-decoder {mode.name} without *_cpu: {syncs} syncs, "
          f"{d2h} DtoH copies per step")
    assert syncs == 0 and d2h == 0, (syncs, d2h)
    expect_host_planned(step(fb), first, seq, prefix, new, loc, enc)

    graph, outs = capture_step(e, fb, layers, (q, k, v), max_tokens=max(tokens, 8),
                               forward=lambda: layer_outputs(fb))

    # Other requests with other encoder lengths, then the first ones grown.
    for reqs, enc_lens, growth, split in (
            ([3, 4, 5], [1, 900, 64], [0, 5, 2000], [90, 3, 3] if extend else new),
            (first, None, [5, 0, 300], [1, 94, 1] if extend else new)):
        seq, prefix, loc, enc = grow(reqs, enc_lens or [0] * bs, growth, split)
        fb.req_pool_indices.copy_(torch.tensor(reqs))
        fb.seq_lens.copy_(torch.tensor(seq))
        fb.encoder_lens.copy_(torch.tensor(enc))
        if extend:
            fb.extend_prefix_lens.copy_(torch.tensor(prefix))
            fb.extend_seq_lens.copy_(torch.tensor(split))
        fb.out_cache_loc.copy_(loc)
        replay_without_syncs(e, fb, graph)
        replayed = [o.clone() for o in outs]
        expect_host_planned(replayed, reqs, seq, prefix, split, loc, enc)


def test_verify_without_host_lengths_is_captured_and_replayed():
    """Issue 15: a TARGET_VERIFY step from device tensors only, captured whole (in_graph and
    every layer) and replayed with longer prefixes and other trees (the engine writes each step's
    tree mask into the same buffer), equal bit for bit to the eager step planned from host
    lengths, with no sync and no device-to-host copy."""
    e = Engine("cuda", num_q_heads=32, num_kv_heads=8, head_dim=128, size=1 << 15, max_reqs=8,
               max_context_len=4096, num_layers=LAYERS)
    bs, draft = 4, 6
    layers = [e.layer(i) for i in range(LAYERS)]
    n = bs * draft
    q, k, v = e.randn(n, 32 * 128), e.randn(n, 8, 128), e.randn(n, 8, 128)
    mask_buffer = torch.zeros(1 << 18, dtype=torch.bool, device="cuda")
    gen = torch.Generator().manual_seed(5)

    def grow(growth):
        """Cached tokens (filled) then a fresh tree of `draft` tokens a request; the tree mask
        written into mask_buffer. Returns (seq_lens, out_cache_loc, the mask's view)."""
        seq, new, masks = [], [], []
        for r in range(bs):
            e.fill(e.add_tokens(r, growth[r]))
            seq.append(len(e.token_slots[r]))
            new.append(e.add_tokens(r, draft))
            tree = torch.rand(draft, draft, generator=gen) < 0.5
            tree = tree.tril() | torch.eye(draft, dtype=torch.bool)
            masks.append(torch.cat([torch.ones(draft, seq[-1], dtype=torch.bool), tree],
                                   dim=1).reshape(-1))
        mask = torch.cat(masks)
        view = mask_buffer[:mask.numel()]
        view.copy_(mask)
        return seq, torch.cat(new), view

    def batch(seq, loc, mask, host_lengths):
        info = types.SimpleNamespace(custom_mask=mask, draft_token_num=draft)
        fb = e.batch(ForwardMode.TARGET_VERIFY, list(range(bs)), seq, out_cache_loc=loc,
                     spec_info=info)
        if not host_lengths:
            fb.seq_lens_cpu = None
        return fb

    seq, loc, mask = grow([200, 30, 900, 1])
    fb = batch(seq, loc, mask, host_lengths=False)
    graph, outs = capture_step(e, fb, layers, (q, k, v), max_tokens=n)
    e.fill(fb.out_cache_loc.clone())  # the capture ran nothing: give its tree tokens K/V
    for growth in ([7, 300, 1, 50], [1, 1, 1, 1], [600, 2, 40, 2000]):
        seq, loc, mask = grow(growth)
        fb.seq_lens.copy_(torch.tensor(seq))
        fb.out_cache_loc.copy_(loc)
        fb.spec_info.custom_mask = mask  # the same storage, this step's length
        replay_without_syncs(e, fb, graph)
        replayed = [o.clone() for o in outs]
        host = batch(seq, loc.clone(), mask, host_lengths=True)
        e.backend.init_forward_metadata(host)
        for layer, got in zip(layers, replayed):
            want = e.backend.forward(q, k, v, layer, host)
            assert torch.isfinite(got).all()
            assert torch.equal(got, want), f"growth {growth}: replay differs from the eager step"


@pytest.mark.parametrize("shared_prefix", ["1", "0"])
def test_multi_step_draft_without_host_lengths_is_captured_and_replayed(shared_prefix,
                                                                        monkeypatch):
    """Issue 15: the multi-step draft from device tensors only (no seq_lens_cpu), its index
    sets and plans built on the device inside the captured graph with every draft step, replayed
    with longer prefixes: no sync, no device-to-host copy, each replay equal bit for bit to the
    eager draft of the same batch and to (shared-prefix path) the eager draft planned from host
    lengths; with KVATTN_DRAFT_SHARED_PREFIX=0 (one decode entry a branch, the CUDA-core plan's
    closed-form chunks) close to it."""
    monkeypatch.setenv("KVATTN_DRAFT_SHARED_PREFIX", shared_prefix)
    e = Engine("cuda", num_q_heads=32, num_kv_heads=8, head_dim=128, size=1 << 15, max_reqs=8,
               max_context_len=4096, num_layers=1)
    topk, steps, bs = 2, 3, 4
    draft = KvattnMultiStepDraftBackend(e.token_to_kv_pool, e.req_to_token_pool, topk, steps,
                                        num_q_heads=32, q_dtype=torch.bfloat16)
    layer = e.layer()
    rows = bs * topk
    qkv = [(e.randn(rows, 32, 128), e.randn(rows, 8, 128), e.randn(rows, 8, 128))
           for _ in range(steps)]

    def grow(growth):
        """Cached tokens (filled), then the draft tokens' slots; returns the committed lengths
        and each draft step's out_cache_loc (branch b of step t at seq + t * topk + b)."""
        seq = []
        for r in range(bs):
            e.fill(e.add_tokens(r, growth[r]))
            seq.append(len(e.token_slots[r]))
            e.add_tokens(r, topk * steps)
        locs = [torch.tensor([e.token_slots[r][seq[r] + t * topk + b]
                              for r in range(bs) for b in range(topk)], device="cuda")
                for t in range(steps)]
        return seq, locs

    def batches(seq, locs, host_lengths):
        info = types.SimpleNamespace(topk=topk, num_steps=steps)
        fb = e.batch(ForwardMode.DECODE, list(range(bs)), seq, spec_info=info)
        if not host_lengths:
            fb.seq_lens_cpu = None
        return fb, [e.batch(ForwardMode.DECODE, list(range(bs)), seq, out_cache_loc=loc)
                    for loc in locs]

    def run_steps(step_fbs):
        return [draft.attn_backends[t].forward(*qkv[t], layer, step_fbs[t]) for t in range(steps)]

    seq, locs = grow([300, 5, 1200, 77])
    fb, step_fbs = batches(seq, locs, host_lengths=False)
    draft.init_cuda_graph_state(8)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        draft.init_forward_metadata_out_graph(fb, in_capture=True)
        with torch.cuda.graph(graph, stream=stream):
            draft.init_forward_metadata_in_graph(fb)
            outs = run_steps(step_fbs)
    torch.cuda.current_stream().wait_stream(stream)
    for loc in locs:  # the capture ran nothing: give its draft tokens K/V (later prefixes)
        e.fill(loc.clone())
    for growth in ([9, 400, 1, 1], [1, 1, 1, 1], [700, 2, 30, 1500]):
        seq, new_locs = grow(growth)
        fb.seq_lens.copy_(torch.tensor(seq))
        for loc, new in zip(locs, new_locs):
            loc.copy_(new)
        replay_without_syncs(draft, fb, graph)
        replayed = [o.clone() for o in outs]
        eager_fb, eager_steps = batches(seq, new_locs, host_lengths=False)
        draft.init_forward_metadata(eager_fb)
        eager = run_steps(eager_steps)
        host_fb, host_steps = batches(seq, new_locs, host_lengths=True)
        draft.init_forward_metadata(host_fb)
        host = run_steps(host_steps)
        for t, (got, want, planned_on_host) in enumerate(zip(replayed, eager, host)):
            assert torch.isfinite(got).all()
            assert torch.equal(got, want), f"growth {growth}, draft step {t}: replay differs"
            if shared_prefix == "1":  # the tile plan is the host's, item for item
                assert torch.equal(got, planned_on_host), f"growth {growth}, step {t}"
            else:  # the CUDA-core plan's closed-form chunks may split differently from the host's
                torch.testing.assert_close(got.float(), planned_on_host.float(), rtol=2e-2,
                                           atol=2e-2)
