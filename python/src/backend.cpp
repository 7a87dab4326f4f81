// kvattn.ForwardBatch, kvattn.BackendConfig, kvattn.Backend (make_backend) and
// kvattn.MultiStepDraftBackend. Kernels run with the GIL released.
#include <nanobind/stl/string.h>

#include <cctype>
#include <chrono>
#include <string>
#include <vector>

#include "bindings.h"

namespace kvattn::python {

const BatchTensorField kBatchTensorFields[kNumBatchTensorFields] = {
    {"req_pool_indices", [](ForwardBatch& b) -> TensorView& { return b.req_pool_indices; }},
    {"seq_lens", [](ForwardBatch& b) -> TensorView& { return b.seq_lens; }},
    {"seq_lens_cpu", [](ForwardBatch& b) -> TensorView& { return b.seq_lens_cpu; }},
    {"extend_prefix_lens", [](ForwardBatch& b) -> TensorView& { return b.extend_prefix_lens; }},
    {"extend_prefix_lens_cpu",
     [](ForwardBatch& b) -> TensorView& { return b.extend_prefix_lens_cpu; }},
    {"extend_seq_lens", [](ForwardBatch& b) -> TensorView& { return b.extend_seq_lens; }},
    {"extend_seq_lens_cpu", [](ForwardBatch& b) -> TensorView& { return b.extend_seq_lens_cpu; }},
    {"out_cache_loc", [](ForwardBatch& b) -> TensorView& { return b.out_cache_loc; }},
    {"encoder_lens", [](ForwardBatch& b) -> TensorView& { return b.encoder_lens; }},
    {"encoder_lens_cpu", [](ForwardBatch& b) -> TensorView& { return b.encoder_lens_cpu; }},
    {"encoder_out_cache_loc",
     [](ForwardBatch& b) -> TensorView& { return b.encoder_out_cache_loc; }},
    {"positions", [](ForwardBatch& b) -> TensorView& { return b.positions; }},
    {"custom_mask", [](ForwardBatch& b) -> TensorView& { return b.spec.custom_mask; }},
    {"shared_prefix_group_cpu",
     [](ForwardBatch& b) -> TensorView& { return b.shared_prefix_group_cpu; }},
    {"shared_prefix_lens_cpu",
     [](ForwardBatch& b) -> TensorView& { return b.shared_prefix_lens_cpu; }},
};

namespace {

std::string upper(std::string text) {
  for (char& c : text) c = char(std::toupper(static_cast<unsigned char>(c)));
  return text;
}

ForwardMode mode_arg(nb::handle value) {
  if (nb::isinstance<ForwardMode>(value)) return nb::cast<ForwardMode>(value);
  std::string name = upper(nb::str(value).c_str());
  const std::string prefix = "FORWARDMODE.";
  if (name.rfind(prefix, 0) == 0) name = name.substr(prefix.size());
  for (ForwardMode mode :
       {ForwardMode::kIdle, ForwardMode::kDecode, ForwardMode::kExtend, ForwardMode::kMixed,
        ForwardMode::kTargetVerify, ForwardMode::kDraftExtend}) {
    if (name == forward_mode_name(mode)) return mode;
  }
  throw_error(ErrorKind::kInvalidArgument, "mode", "got '", name,
              "', expected IDLE, DECODE, EXTEND, MIXED, TARGET_VERIFY or DRAFT_EXTEND");
}

BackendKind kind_arg(nb::handle value) {
  if (nb::isinstance<BackendKind>(value)) return nb::cast<BackendKind>(value);
  return parse_backend_kind(nb::str(value).c_str());
}

TensorCoreDecode tensor_core_arg(nb::handle value) {
  if (nb::isinstance<TensorCoreDecode>(value)) return nb::cast<TensorCoreDecode>(value);
  if (value.is_none()) return TensorCoreDecode::kAuto;
  if (PyBool_Check(value.ptr())) {
    return value.ptr() == Py_True ? TensorCoreDecode::kOn : TensorCoreDecode::kOff;
  }
  const std::string name = nb::str(value).c_str();
  if (name == "auto") return TensorCoreDecode::kAuto;
  if (name == "on") return TensorCoreDecode::kOn;
  if (name == "off") return TensorCoreDecode::kOff;
  throw_error(ErrorKind::kInvalidArgument, "decode_tensor_cores", "got '", name,
              "', expected 'auto', 'on', 'off' or a bool");
}

int batch_field_index(const std::string& name) {
  for (int i = 0; i < kNumBatchTensorFields; ++i) {
    if (name == kBatchTensorFields[i].name) return i;
  }
  return -1;
}

/// Sets one tensor field of a batch: an array (anything DLPack or buffer protocol), a list of
/// ints (made an int32 NumPy array, as engines keep some host lengths as lists), or None.
void set_batch_tensor(PyForwardBatch& b, int index, nb::handle value) {
  const BatchTensorField& field = kBatchTensorFields[index];
  if (value.is_none()) {
    b.arrays[index] = Array();
    b.objects[index] = nb::none();
    field.field(b.batch) = TensorView();
    return;
  }
  Array array;
  nb::object object = nb::borrow(value);
  if (!nb::try_cast(value, array)) {
    if (!PyList_Check(value.ptr()) && !PyTuple_Check(value.ptr())) {
      throw_error(ErrorKind::kInvalidArgument, field.name,
                  "expected an array (NumPy, torch or any __dlpack__ object), a list of ints or "
                  "None, got ",
                  nb::str(nb::handle(Py_TYPE(value.ptr()))).c_str());
    }
    object = int32_numpy(int32_values(value, field.name));
    array = nb::cast<Array>(object);
  }
  const TensorView view = to_view(array, field.name);
  b.arrays[index] = std::move(array);
  b.objects[index] = std::move(object);
  field.field(b.batch) = view;
}

void set_batch_pool(PyForwardBatch& b, nb::handle value) {
  if (value.is_none()) {
    b.req_to_token_pool = nb::none();
    b.batch.req_to_token_pool = nullptr;
    return;
  }
  b.batch.req_to_token_pool = &nb::cast<PyReqToTokenPool&>(value).pool;
  b.req_to_token_pool = nb::borrow(value);
}

void set_batch_cache(PyForwardBatch& b, nb::handle value) {
  if (value.is_none()) {
    b.kv_cache = nb::none();
    b.batch.kv_cache = nullptr;
    return;
  }
  b.batch.kv_cache = &nb::cast<PyKvCache&>(value).cache;
  b.kv_cache = nb::borrow(value);
}

/// Sets a batch attribute by name (the constructor's keyword arguments).
void set_batch_attribute(PyForwardBatch& b, const std::string& name, nb::handle value) {
  const int index = batch_field_index(name);
  if (index >= 0) return set_batch_tensor(b, index, value);
  if (name == "seq_lens_sum") {
    b.batch.seq_lens_sum = nb::cast<int64_t>(value);
  } else if (name == "draft_token_num") {
    b.batch.spec.draft_token_num = nb::cast<int>(value);
  } else if (name == "topk") {
    b.batch.spec.topk = nb::cast<int>(value);
  } else if (name == "num_steps") {
    b.batch.spec.num_steps = nb::cast<int>(value);
  } else if (name == "req_to_token_pool") {
    set_batch_pool(b, value);
  } else if (name == "kv_cache") {
    set_batch_cache(b, value);
  } else {
    throw_error(ErrorKind::kInvalidArgument, name, "is not a ForwardBatch field");
  }
}

void set_config_pools(PyBackendConfig& c, nb::handle kv_cache, nb::handle req_to_token_pool) {
  if (!kv_cache.is_none()) {
    c.config.kv_cache = &nb::cast<PyKvCache&>(kv_cache).cache;
    c.kv_cache = nb::borrow(kv_cache);
  }
  if (!req_to_token_pool.is_none()) {
    c.config.req_to_token_pool = &nb::cast<PyReqToTokenPool&>(req_to_token_pool).pool;
    c.req_to_token_pool = nb::borrow(req_to_token_pool);
  }
}

/// k/v as [num_tokens, num_kv_heads, dim] when given flat as [num_tokens, num_kv_heads * dim]
/// (engines keep them either way; the C++ API takes the 3-D form).
TensorView kv_as_heads(const TensorView& t, int num_kv_heads, int dim) {
  if (!t.defined() || t.ndim() != 2 || num_kv_heads <= 0 || dim <= 0 ||
      t.size(1) != int64_t(num_kv_heads) * dim || t.stride(1) != 1) {
    return t;
  }
  const int64_t shape[3] = {t.size(0), num_kv_heads, dim};
  const int64_t strides[3] = {t.stride(0), dim, 1};
  return TensorView(t.data(), t.dtype(), t.device(), 3, shape, strides);
}

/// The arrays of one forward call. `result` is what the call returns: the caller's `out`, or the
/// output allocated like q when `out` is None.
struct ForwardArgs {
  ArrayArg q, k, v, out;
  nb::object result;
};

ForwardArgs forward_args(DType q_dtype, const AttentionLayer& layer, nb::handle q, nb::handle k,
                         nb::handle v, nb::handle out, bool dlpack_alloc = false) {
  ForwardArgs a;
  a.q = array_arg(q, "q", q_dtype);
  a.k = array_arg(k, "k", q_dtype, /*optional=*/true);
  a.k.view = kv_as_heads(a.k.view, layer.num_kv_heads, layer.head_dim);
  a.v = array_arg(v, "v", q_dtype, /*optional=*/true);
  a.v.view = kv_as_heads(a.v.view, layer.num_kv_heads, layer.resolved_v_head_dim());
  if (out.is_none()) {
    check_arg(a.q.view.ndim() >= 1, "q", "has 0 dimensions, expected [num_tokens, ...]");
    a.result = new_array_like(q, a.q, a.q.view.size(0),
                              int64_t(layer.num_q_heads) * layer.resolved_v_head_dim(), "out",
                              q_dtype, a.out, dlpack_alloc);
  } else {
    a.out = array_arg(out, "out", q_dtype);
    a.result = nb::borrow(out);
  }
  return a;
}

/// This call's layer with the sinks given to it (the engine's layer description stays sink-free,
/// so that one description serves calls with and without).
AttentionLayer layer_with_sinks(const AttentionLayer& layer, const ArrayArg& sinks) {
  AttentionLayer call_layer = layer;
  if (sinks.view.defined()) call_layer.sinks = sinks.view;
  return call_layer;
}

enum class ForwardEntry { kForward, kDecode, kExtend };

ForwardEntry entry_arg(const std::string& name) {
  if (name == "forward") return ForwardEntry::kForward;
  if (name == "forward_decode") return ForwardEntry::kDecode;
  if (name == "forward_extend") return ForwardEntry::kExtend;
  throw_error(ErrorKind::kInvalidArgument, "entry", "got '", name,
              "', expected 'forward', 'forward_decode' or 'forward_extend'");
}

void call_entry(AttentionBackend& impl, ForwardEntry entry, const TensorView& q,
                const TensorView& k, const TensorView& v, const TensorView& out,
                const AttentionLayer& layer, const ForwardBatch& batch, bool save_kv_cache) {
  switch (entry) {
    case ForwardEntry::kForward:
      impl.forward(q, k, v, out, layer, batch, save_kv_cache);
      break;
    case ForwardEntry::kDecode:
      impl.forward_decode(q, k, v, out, layer, batch, save_kv_cache);
      break;
    case ForwardEntry::kExtend:
      impl.forward_extend(q, k, v, out, layer, batch, save_kv_cache);
      break;
  }
}

/// One forward: the arrays are read (zero-copy), the output allocated when not given, and the
/// kernels run with the GIL released. Returns the output.
nb::object run_forward(PyBackend& b, ForwardEntry entry, nb::handle q, nb::handle k, nb::handle v,
                       nb::handle out, const AttentionLayer& layer, const PyForwardBatch& batch,
                       bool save_kv_cache, bool dlpack_alloc, nb::handle sinks) {
  ForwardArgs a = forward_args(b.config.q_dtype, layer, q, k, v, out, dlpack_alloc);
  const ArrayArg sink_arg = array_arg(sinks, "sinks", std::nullopt, /*optional=*/true);
  const AttentionLayer call_layer = layer_with_sinks(layer, sink_arg);
  {
    nb::gil_scoped_release release;
    call_entry(*b.impl, entry, a.q.view, a.k.view, a.v.view, a.out.view, call_layer, batch.batch,
               save_kv_cache);
  }
  return std::move(a.result);
}

template <ForwardEntry kEntry>
nb::object forward_entry(PyBackend& b, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
                         const AttentionLayer& layer, const PyForwardBatch& batch,
                         bool save_kv_cache, bool dlpack_alloc, nb::handle sinks) {
  return run_forward(b, kEntry, q, k, v, out, layer, batch, save_kv_cache, dlpack_alloc, sinks);
}

/// Binds forward / forward_decode / forward_extend: one signature, the entry point differs.
template <ForwardEntry kEntry>
void def_forward(nb::class_<PyBackend>& cls, const char* name, const char* doc) {
  cls.def(name, &forward_entry<kEntry>, nb::arg("q"), nb::arg("k").none(), nb::arg("v").none(),
          nb::arg("out").none(), nb::arg("layer"), nb::arg("batch"),
          nb::arg("save_kv_cache") = true, nb::arg("dlpack_alloc") = false,
          nb::arg("sinks").none() = nb::none(), doc);
}

constexpr const char* kCheckErrorsDoc =
    "Raises the error of the oldest step the device refused since the last call (its .step is "
    "that step's step_id; the message names every refused step it reports), or returns. Each "
    "refused step is reported once; a later good step is never failed by it. Call it where the "
    "engine synchronises anyway (after reading sampled tokens), or pass synchronize=True. The "
    "CPU backend raises from the call itself and has nothing to report here.";
constexpr const char* kTakeStepErrorsDoc =
    "The steps the device refused since the last call, oldest first, each once, as dicts "
    "{step, kind, argument, message}; [] when none.";

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument: return "InvalidArgumentError";
    case ErrorKind::kNotSupported: return "NotSupportedError";
    case ErrorKind::kOutOfResources: return "OutOfResourcesError";
    case ErrorKind::kDeviceError: return "DeviceError";
  }
  return "Error";
}

nb::list step_errors_list(const std::vector<StepError>& errors) {
  nb::list out;
  for (const StepError& e : errors) {
    nb::dict d;
    d["step"] = e.step;
    d["kind"] = error_kind_name(e.kind);
    d["argument"] = e.argument;
    d["message"] = e.message;
    out.append(d);
  }
  return out;
}

template <typename Holder>
Holder make_holder(const PyBackendConfig& c) {
  Holder holder;
  holder.config = c.config;
  holder.kv_cache = c.kv_cache;
  holder.req_to_token_pool = c.req_to_token_pool;
  return holder;
}

}  // namespace

void bind_backend(nb::module_& m) {
  nb::class_<PyForwardBatch> batch_class(
      m, "ForwardBatch",
      "Everything one step needs. Tensor fields take any DLPack array (torch, NumPy, ...), a "
      "list of ints or None; the batch keeps what it is given alive.");
  batch_class
      .def(
          "__init__",
          [](PyForwardBatch* self, nb::handle mode, int batch_size, nb::kwargs kwargs) {
            new (self) PyForwardBatch();
            self->batch.mode = mode_arg(mode);
            self->batch.batch_size = batch_size;
            for (auto [key, value] : kwargs)
              set_batch_attribute(*self, nb::str(key).c_str(), value);
          },
          nb::arg("mode"), nb::arg("batch_size") = 0, nb::arg("kwargs"))
      .def_prop_rw(
          "mode", [](const PyForwardBatch& b) { return b.batch.mode; },
          [](PyForwardBatch& b, nb::handle mode) { b.batch.mode = mode_arg(mode); })
      .def_prop_rw(
          "batch_size", [](const PyForwardBatch& b) { return b.batch.batch_size; },
          [](PyForwardBatch& b, int n) { b.batch.batch_size = n; })
      .def_prop_rw(
          "seq_lens_sum", [](const PyForwardBatch& b) { return b.batch.seq_lens_sum; },
          [](PyForwardBatch& b, int64_t n) { b.batch.seq_lens_sum = n; }, "-1 = compute it")
      .def_prop_rw(
          "draft_token_num", [](const PyForwardBatch& b) { return b.batch.spec.draft_token_num; },
          [](PyForwardBatch& b, int n) { b.batch.spec.draft_token_num = n; })
      .def_prop_rw(
          "topk", [](const PyForwardBatch& b) { return b.batch.spec.topk; },
          [](PyForwardBatch& b, int n) { b.batch.spec.topk = n; })
      .def_prop_rw(
          "num_steps", [](const PyForwardBatch& b) { return b.batch.spec.num_steps; },
          [](PyForwardBatch& b, int n) { b.batch.spec.num_steps = n; })
      .def_prop_rw(
          "req_to_token_pool", [](const PyForwardBatch& b) { return b.req_to_token_pool; },
          [](PyForwardBatch& b, nb::handle pool) { set_batch_pool(b, pool); },
          nb::arg("pool").none())
      .def_prop_rw(
          "kv_cache", [](const PyForwardBatch& b) { return b.kv_cache; },
          [](PyForwardBatch& b, nb::handle cache) { set_batch_cache(b, cache); },
          nb::arg("cache").none())
      .def(
          "num_tokens", [](const PyForwardBatch& b) { return b.batch.num_tokens(); },
          "Query tokens this step carries (reads host lengths).")
      .def("__repr__", [](const PyForwardBatch& b) {
        return std::string("ForwardBatch(mode=") + forward_mode_name(b.batch.mode) +
               ", batch_size=" + std::to_string(b.batch.batch_size) + ")";
      });
  for (int i = 0; i < kNumBatchTensorFields; ++i) {
    batch_class.def_prop_rw(
        kBatchTensorFields[i].name,
        [i](const PyForwardBatch& b) -> nb::object {
          return b.objects[i].is_valid() ? b.objects[i] : nb::none();
        },
        [i](PyForwardBatch& b, nb::handle value) { set_batch_tensor(b, i, value); },
        nb::arg("value").none());
  }

  nb::class_<PyBackendConfig>(m, "BackendConfig",
                              "What a backend is made for: the model's attention shape and the "
                              "engine's pools.")
      .def(
          "__init__",
          [](PyBackendConfig* self, nb::handle kv_cache, nb::handle req_to_token_pool,
             int num_q_heads, int num_kv_heads, int head_dim, int v_head_dim, nb::handle q_dtype,
             int sliding_window_size, bool is_encoder_decoder, int64_t ragged_extend_threshold,
             nb::handle decode_tensor_cores, int num_threads, uintptr_t cuda_stream,
             bool deterministic) {
            new (self) PyBackendConfig();
            set_config_pools(*self, kv_cache, req_to_token_pool);
            BackendConfig& c = self->config;
            c.num_q_heads = num_q_heads;
            c.num_kv_heads = num_kv_heads;
            c.head_dim = head_dim;
            c.v_head_dim = v_head_dim;
            c.q_dtype = dtype_arg(q_dtype);
            c.sliding_window_size = sliding_window_size;
            c.is_encoder_decoder = is_encoder_decoder;
            c.ragged_extend_threshold = ragged_extend_threshold;
            c.decode_tensor_cores = tensor_core_arg(decode_tensor_cores);
            c.num_threads = num_threads;
            c.cuda_stream = reinterpret_cast<void*>(cuda_stream);
            c.deterministic = deterministic;
          },
          nb::kw_only(), nb::arg("kv_cache"), nb::arg("req_to_token_pool"), nb::arg("num_q_heads"),
          nb::arg("num_kv_heads"), nb::arg("head_dim"), nb::arg("v_head_dim") = 0,
          nb::arg("q_dtype") = "bf16", nb::arg("sliding_window_size") = -1,
          nb::arg("is_encoder_decoder") = false, nb::arg("ragged_extend_threshold") = 4096,
          nb::arg("decode_tensor_cores").none() = "auto", nb::arg("num_threads") = 0,
          nb::arg("cuda_stream") = 0, nb::arg("deterministic") = false)
      .def_prop_ro("kv_cache", [](const PyBackendConfig& c) { return c.kv_cache; })
      .def_prop_ro("req_to_token_pool",
                   [](const PyBackendConfig& c) { return c.req_to_token_pool; })
      .def_prop_ro("num_q_heads", [](const PyBackendConfig& c) { return c.config.num_q_heads; })
      .def_prop_ro("num_kv_heads", [](const PyBackendConfig& c) { return c.config.num_kv_heads; })
      .def_prop_ro("head_dim", [](const PyBackendConfig& c) { return c.config.head_dim; })
      .def_prop_ro("v_head_dim", [](const PyBackendConfig& c) { return c.config.v_head_dim; })
      .def_prop_ro("q_dtype", [](const PyBackendConfig& c) { return c.config.q_dtype; })
      .def_prop_ro("sliding_window_size",
                   [](const PyBackendConfig& c) { return c.config.sliding_window_size; })
      .def_prop_ro("is_encoder_decoder",
                   [](const PyBackendConfig& c) { return c.config.is_encoder_decoder; })
      .def_prop_ro("ragged_extend_threshold",
                   [](const PyBackendConfig& c) { return c.config.ragged_extend_threshold; })
      .def_prop_ro("decode_tensor_cores",
                   [](const PyBackendConfig& c) { return c.config.decode_tensor_cores; })
      .def_prop_ro("num_threads", [](const PyBackendConfig& c) { return c.config.num_threads; })
      .def_prop_ro("deterministic",
                   [](const PyBackendConfig& c) { return c.config.deterministic; })
      .def_prop_ro("cuda_stream", [](const PyBackendConfig& c) {
        return reinterpret_cast<uintptr_t>(c.config.cuda_stream);
      });

  const auto forward_doc =
      "q [num_tokens, num_q_heads(, *), head_dim], k/v [num_tokens, num_kv_heads(, *), dim] or "
      "None, out [num_tokens, num_q_heads * v_head_dim] (written) or None (allocated like q: "
      "same library, dtype and device; by q.new_empty, or with dlpack_alloc through q's "
      "library's allocator by DLPack's C exchange API, no Python call). sinks: None or "
      "[num_q_heads] float32/bfloat16/float16 on the backend's device, one attention-sink logit "
      "per q head (AttentionLayer.sinks in C++). Returns out. Runs with the GIL released.";
  nb::class_<PyBackend> backend_class(m, "Backend",
                                      "An attention backend (make one with make_backend).");
  def_forward<ForwardEntry::kForward>(backend_class, "forward", forward_doc);
  def_forward<ForwardEntry::kDecode>(backend_class, "forward_decode",
                                     "forward for a DECODE batch (arguments as in forward).");
  def_forward<ForwardEntry::kExtend>(backend_class, "forward_extend",
                                     "forward for an EXTEND-like batch (arguments as in forward).");
  backend_class
      .def_prop_ro("kind", [](const PyBackend& b) { return b.impl->kind(); })
      .def_prop_ro("device", [](const PyBackend& b) { return b.impl->device().str(); })
      .def_prop_ro("q_dtype", [](const PyBackend& b) { return b.config.q_dtype; })
      .def_prop_ro("num_q_heads", [](const PyBackend& b) { return b.config.num_q_heads; })
      .def_prop_ro("v_head_dim",
                   [](const PyBackend& b) {
                     return b.config.v_head_dim > 0 ? b.config.v_head_dim : b.config.head_dim;
                   })
      .def_prop_ro("kv_cache", [](const PyBackend& b) { return b.kv_cache; })
      .def_prop_ro("req_to_token_pool", [](const PyBackend& b) { return b.req_to_token_pool; })
      .def(
          "init_forward_metadata",
          [](PyBackend& b, const PyForwardBatch& batch) {
            nb::gil_scoped_release release;
            b.impl->init_forward_metadata(batch.batch);
          },
          nb::arg("batch"), "Once per step: = out_graph + in_graph.")
      .def(
          "init_forward_metadata_out_graph",
          [](PyBackend& b, const PyForwardBatch& batch, bool in_capture) {
            nb::gil_scoped_release release;
            b.impl->init_forward_metadata_out_graph(batch.batch, in_capture);
          },
          nb::arg("batch"), nb::arg("in_capture") = false)
      .def(
          "init_forward_metadata_in_graph",
          [](PyBackend& b, const PyForwardBatch& batch) {
            nb::gil_scoped_release release;
            b.impl->init_forward_metadata_in_graph(batch.batch);
          },
          nb::arg("batch"))
      .def(
          "init_cuda_graph_state",
          [](PyBackend& b, int max_bs, int64_t max_num_tokens) {
            nb::gil_scoped_release release;
            b.impl->init_cuda_graph_state(max_bs, max_num_tokens);
          },
          nb::arg("max_bs"), nb::arg("max_num_tokens"))
      .def("get_cuda_graph_seq_len_fill_value",
           [](const PyBackend& b) { return b.impl->cuda_graph_seq_len_fill_value(); })
      .def(
          "set_cuda_stream",
          [](PyBackend& b, uintptr_t stream) {
            b.impl->set_cuda_stream(reinterpret_cast<void*>(stream));
          },
          nb::arg("stream"), "The cudaStream_t (int) later calls run on; set it before a step.")
      .def("on_after_cuda_graph_warmup", [](PyBackend& b) { b.impl->on_after_cuda_graph_warmup(); })
      .def(
          "get_verify_buffers_to_fill_after_draft",
          [](nb::handle self) {
            PyBackend& b = nb::cast<PyBackend&>(self);
            const std::array<TensorView, 2> buffers = b.impl->verify_buffers_to_fill_after_draft();
            nb::list result;
            for (const TensorView& view : buffers) result.append(view_to_array(view, self));
            return result;
          },
          "[tree mask, positions] buffers to fill after draft (None where not needed).")
      .def(
          "update_verify_buffers_to_fill_after_draft",
          [](PyBackend& b, const PyForwardBatch& batch, int cuda_graph_bs) {
            nb::gil_scoped_release release;
            b.impl->update_verify_buffers_to_fill_after_draft(batch.batch, cuda_graph_bs);
          },
          nb::arg("batch"), nb::arg("cuda_graph_bs") = 0)
      .def(
          "init_forward_metadata_for_breakable_cuda_graph_capture",
          [](PyBackend& b, const PyForwardBatch& batch) {
            b.impl->init_forward_metadata_for_breakable_cuda_graph_capture(batch.batch);
          },
          nb::arg("batch"))
      .def(
          "prepare_forward_metadata_for_breakable_cuda_graph_replay",
          [](PyBackend& b, const PyForwardBatch& batch) {
            b.impl->prepare_forward_metadata_for_breakable_cuda_graph_replay(batch.batch);
          },
          nb::arg("batch"))
      .def("supports_indexer_metadata",
           [](const PyBackend& b) { return b.impl->supports_indexer_metadata(); })
      .def_prop_ro(
          "step_id", [](const PyBackend& b) { return b.impl->step_id(); },
          "The number of the step the latest init_forward_metadata(_out_graph) began (1, 2, ...).")
      .def(
          "check_errors",
          [](PyBackend& b, bool synchronize) {
            nb::gil_scoped_release release;
            b.impl->check_errors(synchronize);
          },
          nb::arg("synchronize") = false, kCheckErrorsDoc)
      .def(
          "take_step_errors",
          [](PyBackend& b, bool synchronize) {
            std::vector<StepError> errors;
            {
              nb::gil_scoped_release release;
              errors = b.impl->take_step_errors(synchronize);
            }
            return step_errors_list(errors);
          },
          nb::arg("synchronize") = false, kTakeStepErrorsDoc);

  m.def(
      "make_backend",
      [](nb::handle kind, const PyBackendConfig& config) {
        PyBackend backend = make_holder<PyBackend>(config);
        backend.impl = kvattn::make_backend(kind_arg(kind), config.config);
        return backend;
      },
      nb::arg("kind"), nb::arg("config"),
      "A backend of kind 'cpu' or 'cuda'. Raises NotImplementedError for 'cuda' in a build "
      "without CUDA.");

  nb::class_<PyDraftBackend>(m, "MultiStepDraftBackend",
                             "Speculative multi-step draft: topk branches per request, "
                             "num_steps draft decode steps.")
      .def(
          "__init__",
          [](PyDraftBackend* self, nb::handle kind, const PyBackendConfig& config, int topk,
             int num_steps) {
            new (self) PyDraftBackend(make_holder<PyDraftBackend>(config));
            self->impl = std::make_unique<MultiStepDraftBackend>(kind_arg(kind), config.config,
                                                                 topk, num_steps);
          },
          nb::arg("kind"), nb::arg("config"), nb::arg("topk"), nb::arg("num_steps"))
      .def_prop_ro("topk", [](const PyDraftBackend& d) { return d.impl->topk(); })
      .def_prop_ro("num_steps", [](const PyDraftBackend& d) { return d.impl->num_steps(); })
      .def_prop_ro("q_dtype", [](const PyDraftBackend& d) { return d.config.q_dtype; })
      .def(
          "set_cuda_stream",
          [](PyDraftBackend& d, uintptr_t stream) {
            d.impl->set_cuda_stream(reinterpret_cast<void*>(stream));
          },
          nb::arg("stream"), "The cudaStream_t (int) later calls run on; set it before a step.")
      .def(
          "init_forward_metadata",
          [](PyDraftBackend& d, const PyForwardBatch& batch) {
            nb::gil_scoped_release release;
            d.impl->init_forward_metadata(batch.batch);
          },
          nb::arg("batch"), "batch: mode DECODE, seq_lens = committed prefix lengths.")
      .def(
          "init_forward_metadata_out_graph",
          [](PyDraftBackend& d, const PyForwardBatch& batch, bool in_capture) {
            nb::gil_scoped_release release;
            d.impl->init_forward_metadata_out_graph(batch.batch, in_capture);
          },
          nb::arg("batch"), nb::arg("in_capture") = false,
          "The host half of init_forward_metadata (outside a captured graph).")
      .def(
          "init_forward_metadata_in_graph",
          [](PyDraftBackend& d, const PyForwardBatch& batch) {
            nb::gil_scoped_release release;
            d.impl->init_forward_metadata_in_graph(batch.batch);
          },
          nb::arg("batch"), "The device half of init_forward_metadata (captured in a graph).")
      .def(
          "forward_step",
          [](PyDraftBackend& d, int step, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
             const AttentionLayer& layer, nb::handle out_cache_loc, bool dlpack_alloc,
             nb::handle sinks) {
            ForwardArgs a = forward_args(d.config.q_dtype, layer, q, k, v, out, dlpack_alloc);
            const ArrayArg loc = array_arg(out_cache_loc, "out_cache_loc", std::nullopt,
                                           /*optional=*/true);
            const ArrayArg sink_arg = array_arg(sinks, "sinks", std::nullopt, /*optional=*/true);
            const AttentionLayer call_layer = layer_with_sinks(layer, sink_arg);
            {
              nb::gil_scoped_release release;
              d.impl->forward_step(step, a.q.view, a.k.view, a.v.view, a.out.view, call_layer,
                                   loc.view);
            }
            return std::move(a.result);
          },
          nb::arg("step"), nb::arg("q"), nb::arg("k").none(), nb::arg("v").none(),
          nb::arg("out").none(), nb::arg("layer"), nb::arg("out_cache_loc").none() = nb::none(),
          nb::arg("dlpack_alloc") = false, nb::arg("sinks").none() = nb::none(),
          "One draft step over batch_size * topk query rows (request-major, branch-minor); out "
          "and sinks as in Backend.forward. Returns out.")
      .def(
          "init_cuda_graph_state",
          [](PyDraftBackend& d, int max_bs) {
            nb::gil_scoped_release release;
            d.impl->init_cuda_graph_state(max_bs);
          },
          nb::arg("max_bs"))
      .def_prop_ro("step_id", [](const PyDraftBackend& d) { return d.impl->step_id(); })
      .def(
          "check_errors",
          [](PyDraftBackend& d, bool synchronize) {
            nb::gil_scoped_release release;
            d.impl->check_errors(synchronize);
          },
          nb::arg("synchronize") = false, kCheckErrorsDoc)
      .def(
          "take_step_errors",
          [](PyDraftBackend& d, bool synchronize) {
            std::vector<StepError> errors;
            {
              nb::gil_scoped_release release;
              errors = d.impl->take_step_errors(synchronize);
            }
            return step_errors_list(errors);
          },
          nb::arg("synchronize") = false, kTakeStepErrorsDoc);

  m.def(
      "_forward_loop_us",
      [](PyBackend& b, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
         const AttentionLayer& layer, const PyForwardBatch& batch, int iterations,
         bool save_kv_cache, const std::string& entry_name, bool allocate_out) {
        const ForwardEntry entry = entry_arg(entry_name);
        check_arg(iterations > 0, "iterations", "got ", iterations, ", expected > 0");
        ForwardArgs a = forward_args(b.config.q_dtype, layer, q, k, v, out);
        const int64_t rows = a.q.view.size(0);
        const int64_t width = int64_t(layer.num_q_heads) * layer.resolved_v_head_dim();
        if (allocate_out) {  // fails here, not in the loop, where q's type cannot allocate
          TensorView view;
          free_managed(allocate_managed_like(a.q, rows, width, "out", b.config.q_dtype, view));
        }
        nb::gil_scoped_release release;
        const auto start = std::chrono::steady_clock::now();
        for (int i = 0; i < iterations; ++i) {
          if (allocate_out) {
            TensorView view;
            void* managed = allocate_managed_like(a.q, rows, width, "out", b.config.q_dtype, view);
            call_entry(*b.impl, entry, a.q.view, a.k.view, a.v.view, view, layer, batch.batch,
                       save_kv_cache);
            free_managed(managed);
          } else {
            call_entry(*b.impl, entry, a.q.view, a.k.view, a.v.view, a.out.view, layer, batch.batch,
                       save_kv_cache);
          }
        }
        const std::chrono::duration<double, std::micro> elapsed =
            std::chrono::steady_clock::now() - start;
        return elapsed.count() / iterations;
      },
      nb::arg("backend"), nb::arg("q"), nb::arg("k").none(), nb::arg("v").none(),
      nb::arg("out").none(), nb::arg("layer"), nb::arg("batch"), nb::arg("iterations"),
      nb::arg("save_kv_cache") = true, nb::arg("entry") = "forward",
      nb::arg("allocate_out") = false,
      "Host microseconds per C++ call of a forward entry ('forward', 'forward_decode', "
      "'forward_extend'), looped in C++: the baseline that the Python overhead of forward is "
      "measured against. allocate_out: each call also allocates its output [rows, num_q_heads * "
      "v_head_dim] through q's library (DLPack C exchange API) and frees it, as a C++ caller "
      "would; else every call writes `out`.");
  m.def(
      "_has_exchange_api", [](nb::handle array) { return has_exchange_api(array); },
      nb::arg("array"),
      "True when arrays of this type cross by DLPack's C exchange API (no Python-level "
      "DLPack call per argument; outputs allocated in C).");
}

}  // namespace kvattn::python
