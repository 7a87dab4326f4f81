"""kvattn as a drop-in attention backend for Python serving engines over PyTorch.

:class:`KvattnAttnBackend` has the method names and the call pattern of SGLang's
``AttentionBackend`` (``python/sglang/srt/layers/attention/base_attn_backend.py``): an engine
that drives that interface can construct this class instead of, say, the FlashInfer backend.
Forward batches and layers are duck-typed: any object with the reference's field names works
(the mapping is in python/README.md).

The engine's KV pool and request->token table are wrapped, not copied: kvattn reads and writes
the engine's own torch tensors. Per-step work (``init_forward_metadata*``) builds a native
``kvattn.ForwardBatch`` once; per-layer work (``forward``) is one native call that reads q, k
and v through DLPack's C exchange API (torch >= 2.10: no capsule, no Python-level DLPack call),
allocates the output through torch's allocator and runs the kernel with the GIL released.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Optional

import torch

from . import _kvattn

# torch.Tensor.__dlpack__ spends ~2 us in Python checks; the C entry behind it takes ~0.3 us.
# Both give the same zero-copy capsule. Fall back to the public method where the C entry is gone.
_c_to_dlpack = getattr(torch._C, "_to_dlpack_versioned", None) or getattr(torch._C, "_to_dlpack",
                                                                           None)
if _c_to_dlpack is not None:
    def _dl(tensor: torch.Tensor):
        return _c_to_dlpack(tensor)
else:  # pragma: no cover - older or newer torch without the C entry
    def _dl(tensor: torch.Tensor):
        return tensor


# Fields of the engine's forward batch that become tensor fields of kvattn.ForwardBatch.
_BATCH_TENSOR_FIELDS = (
    "req_pool_indices", "seq_lens", "seq_lens_cpu", "extend_prefix_lens",
    "extend_prefix_lens_cpu", "extend_seq_lens", "extend_seq_lens_cpu", "out_cache_loc",
    "encoder_lens", "encoder_lens_cpu", "encoder_out_cache_loc", "positions",
)
# Shared-prefix (cascade) groups an engine may declare per step, as attributes of its forward
# batch (DECODE / TARGET_VERIFY; kvattn/forward_batch.h): host lists or tensors (a device tensor
# is copied to the host), [batch_size] the group of each request (-1 = none) and [num_groups]
# how many leading req_to_token positions a group's members share.
_SHARED_PREFIX_FIELDS = ("shared_prefix_group_cpu", "shared_prefix_lens_cpu")
# (device tensor, host copy): a CUDA backend plans from host lengths; make them where missing.
_HOST_COPIES = (
    ("seq_lens", "seq_lens_cpu"), ("extend_prefix_lens", "extend_prefix_lens_cpu"),
    ("extend_seq_lens", "extend_seq_lens_cpu"), ("encoder_lens", "encoder_lens_cpu"),
)

# Where torch tensors cross by DLPack's C exchange API (torch >= 2.10), forward hands the tensors
# themselves to the native call and lets it allocate the output; elsewhere they cross as capsules
# and the output is allocated here.
_NATIVE_TENSORS = bool(_kvattn._has_exchange_api(torch.empty(0)))

_FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2")
                    if hasattr(torch, name))


def _asks(obj: Any, method: str) -> bool:
    """obj.method() where the engine's ForwardMode has it, else False."""
    fn = getattr(obj, method, None)
    return bool(fn()) if fn is not None else False


def forward_mode_of(forward_mode: Any) -> _kvattn.ForwardMode:
    """The kvattn mode of an engine's ForwardMode (duck-typed: is_idle(), is_decode(),
    is_target_verify(), is_draft_extend(), is_mixed(); anything else extends). A kvattn
    ForwardMode or its name passes through."""
    if isinstance(forward_mode, (_kvattn.ForwardMode, str)):
        return _kvattn.ForwardBatch(forward_mode).mode
    modes = _kvattn.ForwardMode
    if _asks(forward_mode, "is_idle"):
        return modes.IDLE
    if _asks(forward_mode, "is_decode"):
        return modes.DECODE
    if _asks(forward_mode, "is_target_verify"):
        return modes.TARGET_VERIFY
    if _asks(forward_mode, "is_draft_extend"):
        return modes.DRAFT_EXTEND
    if _asks(forward_mode, "is_mixed"):
        return modes.MIXED
    return modes.EXTEND


def _layer_scale(layer: Any, name: str) -> float:
    """layer.<name>_float, else layer.<name> (None, a float or a one-element tensor); 0 = use
    the KV cache's scale."""
    value = getattr(layer, name + "_float", None)
    if value is None:
        value = getattr(layer, name, None)
    if value is None:
        return 0.0
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def describe_layer(layer: Any, start_layer: int = 0) -> _kvattn.AttentionLayer:
    """kvattn.AttentionLayer of an engine's attention layer (RadixAttention field names)."""
    window = getattr(layer, "sliding_window_size", None)
    logit_cap = getattr(layer, "logit_cap", None)
    head_dim = int(getattr(layer, "qk_head_dim", None) or layer.head_dim)
    return _kvattn.AttentionLayer(
        layer_id=int(layer.layer_id) - start_layer,
        num_q_heads=int(layer.tp_q_head_num),
        num_kv_heads=int(layer.tp_k_head_num),
        head_dim=head_dim,
        v_head_dim=int(getattr(layer, "v_head_dim", None) or head_dim),
        scaling=float(layer.scaling),
        logit_cap=float(logit_cap or 0.0),
        sliding_window_size=-1 if window is None or window < 0 else int(window),
        is_cross_attention=bool(getattr(layer, "is_cross_attention", False)),
        k_scale=_layer_scale(layer, "k_scale"),
        v_scale=_layer_scale(layer, "v_scale"),
    )


def _pool_buffers(token_to_kv_pool: Any):
    """(k buffers, v buffers) of every layer of an engine's KV pool: .k_buffer / .v_buffer lists,
    else get_kv_buffer(layer_id) for layer_num layers from start_layer."""
    k_buffers = getattr(token_to_kv_pool, "k_buffer", None)
    v_buffers = getattr(token_to_kv_pool, "v_buffer", None)
    if k_buffers is not None and v_buffers is not None:
        return list(k_buffers), list(v_buffers)
    start = int(getattr(token_to_kv_pool, "start_layer", 0) or 0)
    pairs = [token_to_kv_pool.get_kv_buffer(start + i)
             for i in range(int(token_to_kv_pool.layer_num))]
    return [k for k, _ in pairs], [v for _, v in pairs]


def wrap_kv_pool(token_to_kv_pool: Any):
    """A kvattn.KvCache over an engine's KV pool tensors (no copy). fp8 pools may store uint8
    (as SGLang does, with .dtype naming the fp8 type) or torch float8 tensors."""
    k_buffers, v_buffers = _pool_buffers(token_to_kv_pool)
    if not k_buffers or len(k_buffers) != len(v_buffers):
        raise ValueError("kvattn: token_to_kv_pool: expected one K and one V buffer per layer")
    first_k, first_v = k_buffers[0], v_buffers[0]
    page_size = int(getattr(token_to_kv_pool, "page_size", 1) or 1)
    logical = getattr(token_to_kv_pool, "dtype", None)
    if not isinstance(logical, torch.dtype):
        logical = first_k.dtype
    # Engines keep one padding page beyond the pool; whole pages only.
    num_slots = first_k.shape[0] // page_size * page_size

    def storage(t: torch.Tensor) -> torch.Tensor:
        t = t[:num_slots]
        return t.view(torch.uint8) if t.dtype in _FP8_DTYPES else t

    config = _kvattn.KvCacheConfig(
        num_layers=len(k_buffers), num_slots=num_slots, num_kv_heads=int(first_k.shape[1]),
        head_dim=int(first_k.shape[2]), v_head_dim=int(first_v.shape[2]), page_size=page_size,
        dtype=logical, device=str(first_k.device))
    return _kvattn.KvCache.wrap(config, [storage(k) for k in k_buffers],
                                [storage(v) for v in v_buffers])


# torch's current cudaStream_t of a device index as an int, with no Stream object made.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _batch_value(value: Any):
    if isinstance(value, torch.Tensor):
        return _dl(value)
    return value  # lists of ints (SGLang's *_cpu lengths) and None pass as they are


class _NativeBackendBase:
    """What KvattnAttnBackend and the draft backend share: the wrapped pools, the layer
    descriptions and the translation of the engine's forward batch."""

    def __init__(self, token_to_kv_pool: Any, req_to_token_pool: Any, *, num_q_heads: int,
                 num_kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
                 v_head_dim: Optional[int] = None, q_dtype: Any = torch.bfloat16,
                 sliding_window_size: Optional[int] = None, is_encoder_decoder: bool = False,
                 kind: Optional[str] = None, ragged_extend_threshold: int = 4096,
                 decode_tensor_cores: Any = "auto", num_threads: int = 0,
                 cuda_stream: Optional[int] = None, output_allocation: str = "torch",
                 deterministic: bool = False):
        if output_allocation not in ("torch", "dlpack"):
            raise ValueError(f"kvattn: output_allocation: got {output_allocation!r}, expected "
                             "'torch' or 'dlpack'")
        # "dlpack": forward's output comes from torch's allocator through DLPack's C exchange API
        # (no Python-level torch call: ~1 us less per call), as a tensor whose storage wraps a
        # DLPack deleter: fixed-size, and record_stream on it is a no-op. "torch": q.new_empty.
        self._dlpack_alloc = output_allocation == "dlpack"
        self.token_to_kv_pool = token_to_kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.kv_cache = wrap_kv_pool(token_to_kv_pool)
        table = req_to_token_pool.req_to_token if hasattr(req_to_token_pool, "req_to_token") \
            else req_to_token_pool
        self.native_req_to_token_pool = _kvattn.ReqToTokenPool.wrap(_dl(table))
        self.start_layer = int(getattr(token_to_kv_pool, "start_layer", 0) or 0)
        cache_config = self.kv_cache.config
        self.device = torch.device(cache_config.device)
        self.kind = kind or ("cuda" if self.device.type == "cuda" else "cpu")
        # Without an explicit stream the backend follows torch's current stream, re-read at each
        # step's metadata call (graph capture runs on a side stream).
        self._follow_current_stream = cuda_stream is None and self.device.type == "cuda"
        if self._follow_current_stream:
            cuda_stream = torch.cuda.current_stream(self.device).cuda_stream
        self._stream = cuda_stream or 0
        self.config = _kvattn.BackendConfig(
            kv_cache=self.kv_cache, req_to_token_pool=self.native_req_to_token_pool,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads or cache_config.num_kv_heads,
            head_dim=head_dim or cache_config.head_dim,
            v_head_dim=v_head_dim or cache_config.resolved_v_head_dim,
            q_dtype=q_dtype,
            sliding_window_size=-1 if sliding_window_size is None else sliding_window_size,
            is_encoder_decoder=is_encoder_decoder,
            ragged_extend_threshold=ragged_extend_threshold,
            decode_tensor_cores=decode_tensor_cores, num_threads=num_threads,
            cuda_stream=cuda_stream or 0, deterministic=bool(deterministic))
        self._layers = {}  # id(layer) -> (layer, kvattn.AttentionLayer, output width)
        self._batch = None  # the kvattn.ForwardBatch of the last step ...
        self._batch_source = None  # ... and the engine's batch it was made from
        self._dispatch_mode = None  # the engine's last forward_mode object seen by forward ...
        self._dispatch_run = None  # ... and the native entry it runs (None: IDLE)

    # ---- layers ---------------------------------------------------------------------------

    def _layer(self, layer: Any):
        entry = self._layers.get(id(layer))
        if entry is None or entry[0] is not layer:
            entry = self._add_layer(layer)
        return entry

    def _add_layer(self, layer: Any):
        native = describe_layer(layer, self.start_layer)
        entry = (layer, native, native.num_q_heads * native.resolved_v_head_dim)
        self._layers[id(layer)] = entry
        return entry

    def invalidate_layer_cache(self) -> None:
        """Forget the layer descriptions made so far (after changing a layer's fields, e.g. its
        fp8 scales, once forward has seen it)."""
        self._layers.clear()

    # ---- batches --------------------------------------------------------------------------

    # A DECODE or TARGET_VERIFY batch without seq_lens_cpu, and an EXTEND-like batch without any
    # *_cpu length, is planned on the device by the CUDA backend (core::uses_device_lengths): no
    # host copy of its lengths, no sync (issue 15); in encoder-decoder models its encoder_lens
    # must be a device tensor without encoder_lens_cpu too. So does the multi-step draft backend
    # for a batch without seq_lens_cpu.
    _plans_decode_on_device = False

    def make_native_batch(self, forward_batch: Any, mode=None) -> _kvattn.ForwardBatch:
        """kvattn.ForwardBatch of an engine's forward batch (no copy of device tensors)."""
        if mode is None:
            mode = forward_mode_of(forward_batch.forward_mode)
        batch = _kvattn.ForwardBatch(mode, int(forward_batch.batch_size))
        batch.req_to_token_pool = self.native_req_to_token_pool
        batch.kv_cache = self.kv_cache
        cuda = self.device.type == "cuda"
        for name in _BATCH_TENSOR_FIELDS:
            value = getattr(forward_batch, name, None)
            if value is not None:
                setattr(batch, name, _batch_value(value))
        for name in _SHARED_PREFIX_FIELDS:
            value = getattr(forward_batch, name, None)
            if value is not None:
                if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                    value = value.cpu()
                setattr(batch, name, _batch_value(value))
        if cuda:
            def on_device(name):
                value = getattr(forward_batch, name, None)
                return isinstance(value, torch.Tensor) and value.device.type != "cpu"

            plain = (self._plans_decode_on_device and
                     getattr(forward_batch, "shared_prefix_group_cpu", None) is None)
            if mode in (_kvattn.ForwardMode.DECODE, _kvattn.ForwardMode.TARGET_VERIFY):
                device_lengths = ("seq_lens",) if plain else ()
            elif mode in (_kvattn.ForwardMode.EXTEND, _kvattn.ForwardMode.MIXED,
                          _kvattn.ForwardMode.DRAFT_EXTEND):
                # Planned on the device only when the engine gave no host length at all (an
                # engine that has them, e.g. SGLang's *_cpu lists, plans on the host for free).
                lengths = ("seq_lens", "extend_prefix_lens", "extend_seq_lens")
                no_host = all(getattr(forward_batch, n + "_cpu", None) is None for n in lengths)
                device_lengths = lengths if (plain and no_host and on_device("seq_lens") and
                                             on_device("extend_prefix_lens") and
                                             on_device("out_cache_loc")) else ()
            else:
                device_lengths = ()
            if device_lengths and self.config.is_encoder_decoder:
                # Encoder-decoder models: the encoder lengths on the device too, or the step
                # plans on the host.
                if on_device("encoder_lens") and \
                        getattr(forward_batch, "encoder_lens_cpu", None) is None:
                    device_lengths = device_lengths + ("encoder_lens",)
                else:
                    device_lengths = ()
            for device_name, host_name in _HOST_COPIES:
                if device_name in device_lengths:
                    continue
                value = getattr(forward_batch, device_name, None)
                if getattr(forward_batch, host_name, None) is None and \
                        isinstance(value, torch.Tensor):
                    setattr(batch, host_name, _dl(value.cpu()))
        seq_lens_sum = getattr(forward_batch, "seq_lens_sum", None)
        if seq_lens_sum is not None:
            batch.seq_lens_sum = int(seq_lens_sum)
        spec_info = getattr(forward_batch, "spec_info", None)
        if spec_info is not None:
            mask = getattr(spec_info, "custom_mask", None)
            if mask is not None:
                batch.custom_mask = _batch_value(mask)
            for name in ("draft_token_num", "topk"):
                value = getattr(spec_info, name, None)
                if value is not None:
                    setattr(batch, name, int(value))
            num_steps = getattr(spec_info, "num_steps", None)
            if num_steps is None:
                num_steps = getattr(spec_info, "speculative_num_steps", None)
            if num_steps is not None:
                batch.num_steps = int(num_steps)
        return batch

    def _bind(self, forward_batch: Any) -> _kvattn.ForwardBatch:
        self._batch = self.make_native_batch(forward_batch)
        self._batch_source = forward_batch
        return self._batch

    def _current(self, forward_batch: Any) -> _kvattn.ForwardBatch:
        if forward_batch is self._batch_source:
            return self._batch
        return self._bind(forward_batch)

    # ---- device-detected bad input ---------------------------------------------------------

    @property
    def step_id(self) -> int:
        """The number of the step the latest init_forward_metadata began (1, 2, ...)."""
        return self.native.step_id

    def check_errors(self, synchronize: bool = False) -> None:
        """Raises the error of the oldest step the GPU refused (a bad index only the device
        could see: the step wrote nothing, its outputs are not valid; ``.step`` is its step_id),
        or returns. Each refused step is reported once; a later good step is never failed by it.
        Call it where the engine synchronises anyway (after reading the sampled tokens), or with
        ``synchronize=True``; then drop that step's results and go on."""
        self.native.check_errors(synchronize)

    def take_step_errors(self, synchronize: bool = False) -> list:
        """The refused steps since the last call, oldest first, each once (dicts with step,
        kind, argument, message)."""
        return self.native.take_step_errors(synchronize)

    def _follow_stream(self) -> None:
        """Points the native backend at torch's current stream when it has moved."""
        if not self._follow_current_stream:
            return
        stream = (_raw_stream(self.device.index or 0) if _raw_stream is not None
                  else torch.cuda.current_stream(self.device).cuda_stream)
        if stream != self._stream:
            self._stream = stream
            self.native.set_cuda_stream(stream)


class KvattnAttnBackend(_NativeBackendBase):
    """kvattn behind SGLang's ``AttentionBackend`` interface (same methods, same call pattern).

    Args:
        token_to_kv_pool: the engine's KV pool: ``k_buffer``/``v_buffer`` lists of
            ``[num_slots, num_kv_heads, head_dim]`` tensors (or ``get_kv_buffer(layer_id)`` and
            ``layer_num``), ``page_size``, ``dtype`` (the logical dtype when fp8 is stored as
            uint8), ``start_layer`` (pipeline stages). Wrapped, never copied.
        req_to_token_pool: has ``req_to_token``, an int32 ``[max_reqs, max_context_len]``
            tensor (or is that tensor). Wrapped, never copied.
        num_q_heads: query heads of this rank (``tp_q_head_num``).
        num_kv_heads, head_dim, v_head_dim: default to the KV pool's.
        q_dtype: dtype of q/k/v and the output (torch dtype or name).
        sliding_window_size: the model's window (None = no window layers).
        is_encoder_decoder: the model has cross-attention layers.
        kind: "cpu" or "cuda"; default: the KV pool's device.
        cuda_stream: the cudaStream_t (int) kernels run on; default: follow torch's current
            stream of the pool's device, read at each step's init_forward_metadata(_out_graph).
        output_allocation: how forward allocates its output: "torch" (``q.new_empty``, an
            ordinary tensor; the default) or "dlpack" (torch's allocator called from C through
            DLPack's C exchange API: about 1 us less per call; the tensor's storage is fixed-size
            and ``record_stream`` on it is a no-op).
    """

    prefill_attention_backend_str: Optional[str] = None
    decode_attention_backend_str: Optional[str] = None
    supports_ragged_verify_graph: bool = False
    needs_cpu_seq_lens: bool = True
    use_captured_forward_metadata_for_breakable_cuda_graph: bool = False

    def __init__(self, token_to_kv_pool: Any, req_to_token_pool: Any, **options: Any):
        super().__init__(token_to_kv_pool, req_to_token_pool, **options)
        self.native = _kvattn.make_backend(self.kind, self.config)
        self._plans_decode_on_device = self.device.type == "cuda"

    @classmethod
    def from_model_runner(cls, model_runner: Any, **options: Any) -> "KvattnAttnBackend":
        """Made the way SGLang makes its backends: from a ModelRunner (its token_to_kv_pool,
        req_to_token_pool, model_config, dtype, sliding_window_size). Options override."""
        model_config = model_runner.model_config
        tp_size = int(options.pop("tp_size", getattr(model_runner, "tp_size", 1)) or 1)
        defaults = dict(
            num_q_heads=model_config.num_attention_heads // tp_size,
            num_kv_heads=model_config.get_num_kv_heads(tp_size),
            head_dim=getattr(model_config, "head_dim", None),
            v_head_dim=getattr(model_config, "v_head_dim", None),
            q_dtype=getattr(model_runner, "dtype", torch.bfloat16),
            sliding_window_size=getattr(model_runner, "sliding_window_size", None),
            is_encoder_decoder=bool(getattr(model_config, "is_encoder_decoder", False)),
            # SGLang's --enable-deterministic-inference asks its backends for batch invariance.
            deterministic=bool(getattr(getattr(model_runner, "server_args", None),
                                       "enable_deterministic_inference", False)),
        )
        defaults.update(options)
        return cls(model_runner.token_to_kv_pool, model_runner.req_to_token_pool, **defaults)

    # ---- per step -------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Eager entry point: out_graph then in_graph."""
        self.init_forward_metadata_out_graph(forward_batch)
        self.init_forward_metadata_in_graph(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False):
        """Host work with dynamic shapes (index arrays, plan); outside CUDA-graph capture."""
        self._follow_stream()
        self.native.init_forward_metadata_out_graph(self._bind(forward_batch), in_capture)

    def init_forward_metadata_in_graph(self, forward_batch: Any) -> None:
        """Static-shape device work; may be recorded in a CUDA graph."""
        self.native.init_forward_metadata_in_graph(self._current(forward_batch))

    # ---- per layer ------------------------------------------------------------------------

    def forward(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                layer: Any, forward_batch: Any, save_kv_cache: bool = True, **kwargs: Any):
        """Run forward on an attention layer: IDLE -> empty, DECODE -> forward_decode, else
        forward_extend (MIXED included: kvattn runs extend and decode requests together).

        The hot path of a serving engine (once per layer per step), kept to one Python frame:
        the dispatch is remembered per forward_mode object, the layer description per layer,
        the native batch per forward batch."""
        sinks = kwargs.pop("sinks", None) if kwargs else None
        if kwargs:
            _reject_extras(kwargs)
        mode = forward_batch.forward_mode
        if mode is not self._dispatch_mode:
            self._set_dispatch(mode)
        run = self._dispatch_run
        if run is None:  # IDLE
            return q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        entry = self._layers.get(id(layer))
        if entry is None or entry[0] is not layer:
            entry = self._add_layer(layer)
        if forward_batch is not self._batch_source:
            self._bind(forward_batch)
        if sinks is not None:
            return self._run_sinks(run, q, k, v, entry, save_kv_cache, sinks)
        if _NATIVE_TENSORS:
            return run(q, k, v, None, entry[1], self._batch, save_kv_cache, self._dlpack_alloc)
        return _run_with_capsules(run, q, k, v, entry, self._batch, save_kv_cache)

    def _run_sinks(self, native_forward, q, k, v, entry, save_kv_cache, sinks):
        """forward with attention sinks ([num_q_heads] per layer, as gpt-oss passes them)."""
        if _NATIVE_TENSORS:
            return native_forward(q, k, v, None, entry[1], self._batch, save_kv_cache,
                                  self._dlpack_alloc, sinks)
        return _run_with_capsules(native_forward, q, k, v, entry, self._batch, save_kv_cache,
                                  sinks)

    def _set_dispatch(self, mode: Any) -> None:
        run = None
        if not mode.is_idle():
            run = self.native.forward_decode if mode.is_decode() else self.native.forward_extend
        self._dispatch_mode, self._dispatch_run = mode, run

    def forward_decode(self, q: torch.Tensor, k: Optional[torch.Tensor],
                       v: Optional[torch.Tensor], layer: Any, forward_batch: Any,
                       save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        return self._run(self.native.forward_decode, q, k, v, layer, forward_batch,
                         save_kv_cache, kwargs)

    def forward_extend(self, q: torch.Tensor, k: Optional[torch.Tensor],
                       v: Optional[torch.Tensor], layer: Any, forward_batch: Any,
                       save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        return self._run(self.native.forward_extend, q, k, v, layer, forward_batch,
                         save_kv_cache, kwargs)

    def _run(self, native_forward, q, k, v, layer, forward_batch, save_kv_cache, kwargs):
        """One native forward into a new output [num_tokens, num_q_heads * v_head_dim]."""
        sinks = kwargs.pop("sinks", None) if kwargs else None
        if kwargs:
            _reject_extras(kwargs)
        entry = self._layers.get(id(layer))
        if entry is None or entry[0] is not layer:
            entry = self._add_layer(layer)
        if forward_batch is not self._batch_source:
            self._bind(forward_batch)
        if sinks is not None:
            return self._run_sinks(native_forward, q, k, v, entry, save_kv_cache, sinks)
        if _NATIVE_TENSORS:
            return native_forward(q, k, v, None, entry[1], self._batch, save_kv_cache,
                                  self._dlpack_alloc)
        return _run_with_capsules(native_forward, q, k, v, entry, self._batch, save_kv_cache)

    def forward_mixed(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True):
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache)

    # ---- CUDA graphs ----------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.native.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.native.get_cuda_graph_seq_len_fill_value()

    def on_after_cuda_graph_warmup(self) -> None:
        self.native.on_after_cuda_graph_warmup()

    def init_forward_metadata_for_breakable_cuda_graph_capture(self, forward_batch: Any):
        self.native.init_forward_metadata_for_breakable_cuda_graph_capture(
            self._bind(forward_batch))

    def prepare_forward_metadata_for_breakable_cuda_graph_replay(
            self, capture_metadata: Any, forward_batch: Any, *,
            static_forward_batch: Any = None) -> None:
        self.native.prepare_forward_metadata_for_breakable_cuda_graph_replay(
            self._bind(forward_batch))

    # ---- speculative decoding -------------------------------------------------------------

    def get_verify_buffers_to_fill_after_draft(self):
        """[tree mask, positions] as torch tensors over the backend's buffers, or None."""
        return [None if buffer is None else torch.from_dlpack(buffer)
                for buffer in self.native.get_verify_buffers_to_fill_after_draft()]

    def update_verify_buffers_to_fill_after_draft(self, spec_info: Any,
                                                  cuda_graph_bs: Optional[int]) -> None:
        if self._batch is not None:
            self.native.update_verify_buffers_to_fill_after_draft(self._batch,
                                                                  int(cuda_graph_bs or 0))

    # ---- the rest of the reference interface ----------------------------------------------

    def support_triton(self) -> bool:
        return True

    def get_indexer_metadata(self, layer_id: int, forward_batch: Any):
        """None: kvattn has no sparse-attention indexer."""
        return None


def _run_with_capsules(native_forward, q, k, v, layer_entry, batch, save_kv_cache, sinks=None):
    """forward where torch has no DLPack C exchange API: the output allocated here, every tensor
    crossing as a DLPack capsule."""
    out = q.new_empty((q.shape[0], layer_entry[2]))
    native_forward(_dl(q), None if k is None else _dl(k), None if v is None else _dl(v),
                   _dl(out), layer_entry[1], batch, save_kv_cache, False,
                   None if sinks is None else _dl(sinks))
    return out


def _reject_extras(kwargs: dict) -> None:
    given = sorted(name for name, value in kwargs.items() if value is not None)
    if given:
        raise NotImplementedError(
            f"kvattn: forward: arguments {given} are not supported by the kvattn backend")


class _DraftStepBackend:
    """One step of a KvattnMultiStepDraftBackend, with the per-step backend's forward."""

    def __init__(self, owner: "KvattnMultiStepDraftBackend", step: int):
        self.owner = owner
        self.step = step

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        sinks = kwargs.pop("sinks", None) if kwargs else None
        if kwargs:
            _reject_extras(kwargs)
        _, native_layer, width = self.owner._layer(layer)
        loc = getattr(forward_batch, "out_cache_loc", None) if save_kv_cache else None
        if loc is None:
            k = v = None
        if _NATIVE_TENSORS:
            return self.owner.native.forward_step(self.step, q, k, v, None, native_layer, loc,
                                                  self.owner._dlpack_alloc, sinks)
        out = q.new_empty((q.shape[0], width))
        self.owner.native.forward_step(
            self.step, _dl(q), None if k is None else _dl(k), None if v is None else _dl(v),
            _dl(out), native_layer, None if loc is None else _dl(loc), False,
            None if sinks is None else _dl(sinks))
        return out

    forward_decode = forward


class KvattnMultiStepDraftBackend(_NativeBackendBase):
    """Multi-step speculative draft (SGLang's ``*MultiStepDraftBackend`` shape): ``topk``
    branches per request, ``speculative_num_steps`` draft decode steps, index sets of all steps
    built in one ``init_forward_metadata``; ``attn_backends[i].forward`` runs step i."""

    def __init__(self, token_to_kv_pool: Any, req_to_token_pool: Any, topk: int,
                 speculative_num_steps: int, **options: Any):
        super().__init__(token_to_kv_pool, req_to_token_pool, **options)
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.native = _kvattn.MultiStepDraftBackend(self.kind, self.config, topk,
                                                    speculative_num_steps)
        self.attn_backends = [_DraftStepBackend(self, i) for i in range(speculative_num_steps)]
        # A batch without seq_lens_cpu is planned on the device (no host copy, no sync).
        self._plans_decode_on_device = self.device.type == "cuda"

    def _bind_draft(self, forward_batch: Any) -> _kvattn.ForwardBatch:
        batch = self.make_native_batch(forward_batch, mode=_kvattn.ForwardMode.DECODE)
        batch.topk = self.topk
        batch.num_steps = self.speculative_num_steps
        self._batch, self._batch_source = batch, forward_batch
        self._follow_stream()
        return batch

    def init_forward_metadata(self, forward_batch: Any) -> None:
        self.native.init_forward_metadata(self._bind_draft(forward_batch))

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False):
        """The host half (before a capture, with in_capture=True, and before each replay)."""
        self.native.init_forward_metadata_out_graph(self._bind_draft(forward_batch), in_capture)

    def init_forward_metadata_in_graph(self, forward_batch: Any) -> None:
        """The device half: inside the captured graph, before the draft steps."""
        if forward_batch is self._batch_source:
            batch = self._batch
            self._follow_stream()
        else:
            batch = self._bind_draft(forward_batch)
        self.native.init_forward_metadata_in_graph(batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: Optional[int] = None) -> None:
        self.native.init_cuda_graph_state(max_bs)


def measure_forward_overhead_us(backend: KvattnAttnBackend, q, k, v, layer, forward_batch,
                                save_kv_cache: bool = False, iterations: int = 100,
                                repeats: int = 41, warmup: int = 3) -> dict:
    """Host microseconds per call of ``backend.forward`` and of the same native forward looped
    in C++ (no Python), and their difference: the per-call Python overhead.

    Like with like: the C++ loop calls the same native entry (forward_decode / forward_extend)
    on the same views and, as forward does, allocates each call's output through torch's
    allocator (DLPack C exchange API) and frees it. Where torch lacks that API the loop writes
    one preallocated output instead (``native_allocates`` says which).

    Robust to noise: ``warmup`` untimed rounds, then ``repeats`` rounds of ``iterations`` calls,
    the Python loop and the C++ loops interleaved in each round, the garbage collector off while
    timing; the device is synchronized around every loop and a loop's calls are few enough not to
    fill the launch queue, so kernel time stays out. The *_us numbers are each loop's minimum over
    the rounds (the run least disturbed by the rest of the machine); ``*_median_us`` are medians,
    ``overhead_median_us`` the median of the rounds' paired differences. ``overhead_vs_preallocated_us``
    compares against the C++ loop that allocates nothing."""
    mode = forward_mode_of(forward_batch.forward_mode)
    entry = "forward_decode" if mode == _kvattn.ForwardMode.DECODE else "forward_extend"
    native_layer = backend._layer(layer)[1]
    backend.forward(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache)  # binds, checks
    batch = backend._current(forward_batch)
    out = backend.forward(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache)
    native_allocates = _NATIVE_TENSORS
    # Without the C exchange API the tensors cross as DLPack capsules, each consumed once.
    cross = (lambda t: t) if _NATIVE_TENSORS else (lambda t: None if t is None else _dl(t))
    cuda = backend.device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(backend.device)

    def python_loop():
        sync()
        start = time.perf_counter()
        for _ in range(iterations):
            backend.forward(q, k, v, layer, forward_batch, save_kv_cache)
        elapsed = (time.perf_counter() - start) / iterations * 1e6
        sync()
        return elapsed

    def native_loop(allocate):
        sync()
        elapsed = _kvattn._forward_loop_us(
            backend.native, cross(q), cross(k), cross(v), None if allocate else cross(out),
            native_layer, batch, iterations, save_kv_cache, entry, allocate)
        sync()
        return elapsed

    python_runs, native_runs, prealloc_runs = [], [], []
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for round_ in range(warmup + repeats):
            p = python_loop()
            n = native_loop(native_allocates)
            f = native_loop(False)
            if round_ >= warmup:
                python_runs.append(p)
                native_runs.append(n)
                prealloc_runs.append(f)
    finally:
        if gc_was_enabled:
            gc.enable()

    def median(values):
        ordered = sorted(values)
        return ordered[len(ordered) // 2]

    python_us, native_us, prealloc_us = min(python_runs), min(native_runs), min(prealloc_runs)
    return {"python_us": python_us, "native_us": native_us, "overhead_us": python_us - native_us,
            "python_median_us": median(python_runs), "native_median_us": median(native_runs),
            "overhead_median_us": median([p - n for p, n in zip(python_runs, native_runs)]),
            "native_preallocated_us": prealloc_us,
            "overhead_vs_preallocated_us": python_us - prealloc_us,
            "native_allocates": native_allocates, "iterations": iterations, "repeats": repeats}
