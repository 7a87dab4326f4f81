"""kvattn: paged-KV attention for LLM serving engines.

The C++ core (decode, extend with a cached prefix, speculative verify and draft, on the CPU and
on CUDA) behind one backend interface, reached from Python with tensors crossing by DLPack,
zero-copy, in both directions: torch tensors (CPU and CUDA), NumPy arrays, anything with
``__dlpack__``.

Two ways in:

* this module: the C++ API one to one (``KvCache``, ``ReqToTokenPool``, ``SlotAllocator``,
  ``AttentionLayer``, ``ForwardBatch``, ``make_backend``, ``MultiStepDraftBackend``), for NumPy,
  torch or any DLPack producer;
* ``kvattn.torch_backend.KvattnAttnBackend``: a drop-in attention backend for engines built on
  the SGLang ``AttentionBackend`` interface (duck-typed forward batches and layers).

Errors are ``kvattn.Error`` subclasses that are also the matching builtin exceptions:
``InvalidArgumentError`` (ValueError), ``NotSupportedError`` (NotImplementedError),
``OutOfResourcesError`` (MemoryError), ``DeviceError`` (RuntimeError); ``.argument`` names the
argument at fault. The log-sum-exp convention of the library is the natural log.
"""

from __future__ import annotations

import numpy as np

from . import _kvattn
from ._kvattn import (
    AttentionLayer,
    BackendConfig,
    BackendKind,
    DeviceError,
    DType,
    Error,
    ForwardBatch,
    ForwardMode,
    InvalidArgumentError,
    KvCache,
    KvCacheConfig,
    NotSupportedError,
    OutOfResourcesError,
    ReqToTokenPool,
    SlotAllocator,
    TensorCoreDecode,
    cuda_compiled,
    cuda_device_count,
    dtype,
    dtype_name,
)
from ._arrays import as_bits_if_ml_dtype, empty_output

__version__ = "0.1.0"

__all__ = [
    "AttentionLayer",
    "Backend",
    "BackendConfig",
    "BackendKind",
    "DType",
    "DeviceError",
    "Error",
    "ForwardBatch",
    "ForwardMode",
    "InvalidArgumentError",
    "KvCache",
    "KvCacheConfig",
    "MultiStepDraftBackend",
    "NotSupportedError",
    "OutOfResourcesError",
    "ReqToTokenPool",
    "SlotAllocator",
    "TensorCoreDecode",
    "cuda_compiled",
    "cuda_device_count",
    "dtype",
    "dtype_name",
    "empty_output",
    "make_backend",
]


class Backend:
    """One attention backend (SPEC section 4); made by :func:`make_backend`.

    ``forward`` allocates the output ``[num_tokens, num_q_heads * v_head_dim]`` (same array kind,
    dtype and device as ``q``) unless ``out`` is given. Everything else is the C++ interface one
    to one; ``native`` is the underlying ``kvattn._kvattn.Backend``.
    """

    __slots__ = ("native", "_q_dtype")

    def __init__(self, native: _kvattn.Backend):
        self.native = native
        self._q_dtype = dtype_name(native.q_dtype)

    @property
    def kind(self):
        return self.native.kind

    @property
    def device(self) -> str:
        return self.native.device

    @property
    def kv_cache(self):
        return self.native.kv_cache

    @property
    def req_to_token_pool(self):
        return self.native.req_to_token_pool

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Once per step: index arrays, masks and the work plan (= out_graph + in_graph)."""
        self.native.init_forward_metadata(batch)

    def init_forward_metadata_out_graph(self, batch: ForwardBatch, in_capture: bool = False):
        self.native.init_forward_metadata_out_graph(batch, in_capture)

    def init_forward_metadata_in_graph(self, batch: ForwardBatch) -> None:
        self.native.init_forward_metadata_in_graph(batch)

    def _run(self, native_forward, q, k, v, layer, batch, save_kv_cache, out):
        """NumPy arrays: the output allocated here (NumPy has no allocator that C can call) and
        ml_dtypes arrays as views of their bits. Anything else (torch, ...) goes as it is; the
        native call allocates a missing output like q and returns the output."""
        if type(q) is not np.ndarray and type(k) is not np.ndarray and \
                type(v) is not np.ndarray and type(out) is not np.ndarray:
            return native_forward(q, k, v, out, layer, batch, save_kv_cache)
        if out is None:
            out = empty_output(q, q.shape[0], layer.num_q_heads * layer.resolved_v_head_dim)
        expected = self._q_dtype
        native_forward(as_bits_if_ml_dtype(q, expected, "q"), as_bits_if_ml_dtype(k, expected, "k"),
                       as_bits_if_ml_dtype(v, expected, "v"),
                       as_bits_if_ml_dtype(out, expected, "out"), layer, batch, save_kv_cache)
        return out

    def forward(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch,
                save_kv_cache: bool = True, out=None):
        """Per layer: dispatches on batch.mode; returns out (allocated like q when not given)."""
        return self._run(self.native.forward, q, k, v, layer, batch, save_kv_cache, out)

    def forward_decode(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch,
                       save_kv_cache: bool = True, out=None):
        return self._run(self.native.forward_decode, q, k, v, layer, batch, save_kv_cache, out)

    def forward_extend(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch,
                       save_kv_cache: bool = True, out=None):
        return self._run(self.native.forward_extend, q, k, v, layer, batch, save_kv_cache, out)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.native.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.native.get_cuda_graph_seq_len_fill_value()

    def on_after_cuda_graph_warmup(self) -> None:
        self.native.on_after_cuda_graph_warmup()

    def get_verify_buffers_to_fill_after_draft(self):
        """[tree mask, positions]: DLPack arrays over the backend's buffers, or None."""
        return self.native.get_verify_buffers_to_fill_after_draft()

    def update_verify_buffers_to_fill_after_draft(self, batch: ForwardBatch,
                                                  cuda_graph_bs: int = 0) -> None:
        self.native.update_verify_buffers_to_fill_after_draft(batch, cuda_graph_bs)

    def init_forward_metadata_for_breakable_cuda_graph_capture(self, batch: ForwardBatch):
        self.native.init_forward_metadata_for_breakable_cuda_graph_capture(batch)

    def prepare_forward_metadata_for_breakable_cuda_graph_replay(self, batch: ForwardBatch):
        self.native.prepare_forward_metadata_for_breakable_cuda_graph_replay(batch)

    def supports_indexer_metadata(self) -> bool:
        return self.native.supports_indexer_metadata()

    @property
    def step_id(self) -> int:
        """The number of the step the latest init_forward_metadata(_out_graph) began (1, 2...)."""
        return self.native.step_id

    def check_errors(self, synchronize: bool = False) -> None:
        """Raises the error of the oldest step the device refused (``.step`` names it; the
        message lists every refused step reported), or returns. Each refused step is reported
        once, and a later good step is never failed by it: call this where the engine
        synchronises anyway (after reading the sampled tokens), or with ``synchronize=True``.
        A refused step wrote nothing (KV pool as before; its outputs were not computed)."""
        self.native.check_errors(synchronize)

    def take_step_errors(self, synchronize: bool = False) -> list:
        """The refused steps since the last call, oldest first, each once:
        ``[{"step", "kind", "argument", "message"}, ...]``."""
        return self.native.take_step_errors(synchronize)


def _wrap_kv_cache(config: KvCacheConfig, k_buffers, v_buffers) -> KvCache:
    """Wraps engine-owned buffers, one K and one V array per layer, without copying. bf16/fp16
    storage may come as uint16 arrays of the bits, fp8 as uint8, or as ml_dtypes arrays."""
    expected = dtype_name(config.dtype)
    return _native_wrap(config,
                        [as_bits_if_ml_dtype(b, expected, "k_buffers") for b in k_buffers],
                        [as_bits_if_ml_dtype(b, expected, "v_buffers") for b in v_buffers])


_native_wrap = KvCache.wrap
KvCache.wrap = staticmethod(_wrap_kv_cache)


def make_backend(kind, config: BackendConfig) -> Backend:
    """A backend of kind ``"cpu"`` or ``"cuda"`` (or a :class:`BackendKind`) for ``config``."""
    return Backend(_kvattn.make_backend(kind, config))


class MultiStepDraftBackend:
    """Speculative multi-step draft: ``topk`` branches per request, ``num_steps`` draft decode
    steps; ``init_forward_metadata`` builds the index sets of all steps in one go."""

    __slots__ = ("native",)

    def __init__(self, kind, config: BackendConfig, topk: int, num_steps: int):
        self.native = _kvattn.MultiStepDraftBackend(kind, config, topk, num_steps)

    @property
    def topk(self) -> int:
        return self.native.topk

    @property
    def num_steps(self) -> int:
        return self.native.num_steps

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.native.init_forward_metadata(batch)

    def forward_step(self, step: int, q, k, v, layer: AttentionLayer, out_cache_loc=None,
                     out=None):
        """One draft step: q/k/v have batch_size * topk rows (request-major, branch-minor);
        k/v are saved at out_cache_loc when given. Returns out."""
        if out is None:
            out = empty_output(q, q.shape[0], layer.num_q_heads * layer.resolved_v_head_dim)
        expected = dtype_name(self.native.q_dtype)
        self.native.forward_step(step, as_bits_if_ml_dtype(q, expected, "q"),
                                 as_bits_if_ml_dtype(k, expected, "k"),
                                 as_bits_if_ml_dtype(v, expected, "v"),
                                 as_bits_if_ml_dtype(out, expected, "out"), layer, out_cache_loc)
        return out

    def init_cuda_graph_state(self, max_bs: int) -> None:
        self.native.init_cuda_graph_state(max_bs)

    @property
    def step_id(self) -> int:
        return self.native.step_id

    def check_errors(self, synchronize: bool = False) -> None:
        """As :meth:`Backend.check_errors`: one step is one init_forward_metadata."""
        self.native.check_errors(synchronize)

    def take_step_errors(self, synchronize: bool = False) -> list:
        return self.native.take_step_errors(synchronize)
