// kvattn._kvattn: the module entry point, the error mapping, the enums, the layer description
// and the small helpers every other part uses.
#include <nanobind/stl/string.h>

#include <algorithm>
#include <cctype>
#include <string>

#include "bindings.h"

namespace kvattn::python {

namespace {

/// The Python exception type of each ErrorKind, in ErrorKind order; created at import.
PyObject* g_error_types[4] = {};

PyObject* new_error_type(nb::module_& m, const char* name, PyObject* base, PyObject* builtin,
                         const char* doc) {
  const std::string qualified = std::string("kvattn.") + name;
  nb::object bases = builtin ? nb::object(nb::make_tuple(nb::handle(base), nb::handle(builtin)))
                             : nb::object(nb::borrow(base));
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), nullptr);
  if (!type) throw nb::python_error();
  m.attr(name) = nb::handle(type);
  return type;  // one reference stays with us for the translator (the module owns another)
}

void translate_error(const std::exception_ptr& error, void*) {
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    PyObject* type = g_error_types[int(e.kind())];
    nb::object instance = nb::steal(PyObject_CallFunction(type, "s", e.what()));
    if (!instance.is_valid()) return;  // the call set its own error
    nb::setattr(instance, "argument", nb::str(e.argument().c_str()));
    // The step a device-detected error belongs to (check_errors), else None.
    nb::setattr(instance, "step", e.step() >= 0 ? nb::object(nb::int_(e.step())) : nb::none());
    PyErr_SetObject(type, instance.ptr());
  }
}

std::string normalized_dtype_name(std::string name) {
  for (const char* prefix : {"torch.", "numpy.", "np."}) {
    if (name.rfind(prefix, 0) == 0) name = name.substr(std::string(prefix).size());
  }
  static const std::pair<const char*, const char*> kAliases[] = {
      {"float32", "fp32"},
      {"float", "fp32"},
      {"bfloat16", "bf16"},
      {"float16", "fp16"},
      {"half", "fp16"},
      {"float8_e4m3fn", "fp8_e4m3"},
      {"float8_e4m3", "fp8_e4m3"},
      {"float8_e5m2", "fp8_e5m2"},
      {"int", "int32"},
      {"long", "int64"},
      {"bool", "uint8"},
  };
  for (const auto& [alias, canonical] : kAliases) {
    if (name == alias) return canonical;
  }
  return name;
}

}  // namespace

DType dtype_arg(nb::handle value) {
  if (nb::isinstance<DType>(value)) return nb::cast<DType>(value);
  // Strings, torch dtypes and NumPy dtypes all print as their name.
  return parse_dtype(normalized_dtype_name(nb::str(value).c_str()));
}

Device device_arg(nb::handle value) {
  // Strings and torch.device print as "cpu", "cuda" or "cuda:N".
  std::string text = nb::str(value).c_str();
  if (text == "cpu") return Device::cpu();
  if (text == "cuda") return Device::cuda(0);
  if (text.rfind("cuda:", 0) == 0 && text.size() > 5 &&
      std::all_of(text.begin() + 5, text.end(), [](char c) { return std::isdigit(c) != 0; })) {
    return Device::cuda(std::stoi(text.substr(5)));
  }
  throw_error(ErrorKind::kInvalidArgument, "device", "got '", text,
              "', expected 'cpu', 'cuda' or 'cuda:N'");
}

void bind_basics(nb::module_& m) {
  PyObject* base = PyErr_NewExceptionWithDoc(
      "kvattn.Error",
      "Base of every error kvattn raises; .argument names the argument at fault, .step the "
      "refused step of an error that check_errors() reports (None otherwise).",
      PyExc_Exception, nullptr);
  if (!base) throw nb::python_error();
  m.attr("Error") = nb::handle(base);
  g_error_types[int(ErrorKind::kInvalidArgument)] =
      new_error_type(m, "InvalidArgumentError", base, PyExc_ValueError,
                     "A shape, dtype, device, range or value that the contract forbids.");
  g_error_types[int(ErrorKind::kNotSupported)] =
      new_error_type(m, "NotSupportedError", base, PyExc_NotImplementedError,
                     "A valid request this backend or build cannot serve.");
  g_error_types[int(ErrorKind::kOutOfResources)] =
      new_error_type(m, "OutOfResourcesError", base, PyExc_MemoryError,
                     "An allocator, pool or buffer is exhausted.");
  g_error_types[int(ErrorKind::kDeviceError)] =
      new_error_type(m, "DeviceError", base, PyExc_RuntimeError, "A CUDA call failed.");
  nb::register_exception_translator(translate_error);

  nb::enum_<DType>(m, "DType", "Element type of a tensor.")
      .value("fp32", DType::kFloat32)
      .value("bf16", DType::kBFloat16)
      .value("fp16", DType::kFloat16)
      .value("fp8_e4m3", DType::kFloat8E4M3)
      .value("fp8_e5m2", DType::kFloat8E5M2)
      .value("int32", DType::kInt32)
      .value("int64", DType::kInt64)
      .value("uint8", DType::kUInt8);

  nb::enum_<ForwardMode>(m, "ForwardMode", "The forward modes of SPEC section 2.")
      .value("IDLE", ForwardMode::kIdle)
      .value("DECODE", ForwardMode::kDecode)
      .value("EXTEND", ForwardMode::kExtend)
      .value("MIXED", ForwardMode::kMixed)
      .value("TARGET_VERIFY", ForwardMode::kTargetVerify)
      .value("DRAFT_EXTEND", ForwardMode::kDraftExtend);

  nb::enum_<BackendKind>(m, "BackendKind")
      .value("cpu", BackendKind::kCpu)
      .value("cuda", BackendKind::kCuda);

  nb::enum_<TensorCoreDecode>(m, "TensorCoreDecode",
                              "Whether decode runs the tensor-core kernel (auto: GQA > 4 or fp8).")
      .value("auto", TensorCoreDecode::kAuto)
      .value("on", TensorCoreDecode::kOn)
      .value("off", TensorCoreDecode::kOff);

  nb::class_<AttentionLayer>(m, "AttentionLayer", "One attention layer (RadixAttention).")
      .def(nb::init<>())
      .def(
          "__init__",
          [](AttentionLayer* self, int layer_id, int num_q_heads, int num_kv_heads, int head_dim,
             int v_head_dim, float scaling, float logit_cap, int sliding_window_size,
             bool is_cross_attention, float k_scale, float v_scale) {
            new (self) AttentionLayer();
            self->layer_id = layer_id;
            self->num_q_heads = num_q_heads;
            self->num_kv_heads = num_kv_heads;
            self->head_dim = head_dim;
            self->v_head_dim = v_head_dim;
            self->scaling = scaling;
            self->logit_cap = logit_cap;
            self->sliding_window_size = sliding_window_size;
            self->is_cross_attention = is_cross_attention;
            self->k_scale = k_scale;
            self->v_scale = v_scale;
          },
          nb::kw_only(), nb::arg("layer_id") = 0, nb::arg("num_q_heads"), nb::arg("num_kv_heads"),
          nb::arg("head_dim"), nb::arg("v_head_dim") = 0, nb::arg("scaling"),
          nb::arg("logit_cap") = 0.f, nb::arg("sliding_window_size") = -1,
          nb::arg("is_cross_attention") = false, nb::arg("k_scale") = 0.f, nb::arg("v_scale") = 0.f)
      .def_rw("layer_id", &AttentionLayer::layer_id)
      .def_rw("num_q_heads", &AttentionLayer::num_q_heads)
      .def_rw("num_kv_heads", &AttentionLayer::num_kv_heads)
      .def_rw("head_dim", &AttentionLayer::head_dim)
      .def_rw("v_head_dim", &AttentionLayer::v_head_dim, "0 means head_dim")
      .def_rw("scaling", &AttentionLayer::scaling)
      .def_rw("logit_cap", &AttentionLayer::logit_cap, "soft-cap; 0 = off")
      .def_rw("sliding_window_size", &AttentionLayer::sliding_window_size, "-1 = full attention")
      .def_rw("is_cross_attention", &AttentionLayer::is_cross_attention)
      .def_rw("k_scale", &AttentionLayer::k_scale, "fp8 scale; <= 0 = the KV cache's")
      .def_rw("v_scale", &AttentionLayer::v_scale, "fp8 scale; <= 0 = the KV cache's")
      .def_prop_ro("resolved_v_head_dim", &AttentionLayer::resolved_v_head_dim)
      .def("__repr__", [](const AttentionLayer& l) {
        return "AttentionLayer(layer_id=" + std::to_string(l.layer_id) +
               ", num_q_heads=" + std::to_string(l.num_q_heads) +
               ", num_kv_heads=" + std::to_string(l.num_kv_heads) +
               ", head_dim=" + std::to_string(l.head_dim) +
               ", v_head_dim=" + std::to_string(l.resolved_v_head_dim()) +
               ", scaling=" + std::to_string(l.scaling) +
               ", logit_cap=" + std::to_string(l.logit_cap) +
               ", sliding_window_size=" + std::to_string(l.sliding_window_size) +
               ", is_cross_attention=" + (l.is_cross_attention ? "True" : "False") + ")";
      });

  m.def(
      "dtype_name",
      [](nb::handle dtype) { return std::string(kvattn::dtype_name(dtype_arg(dtype))); },
      "The canonical name of a dtype ('bf16', 'fp8_e4m3', ...); accepts torch/NumPy dtypes.");
  m.def(
      "dtype", [](nb::handle dtype) { return dtype_arg(dtype); },
      "The kvattn DType of a DType, a name, or a torch/NumPy dtype.");
  m.def("cuda_compiled", &cuda_compiled, "True when this build has its CUDA backend.");
  m.def("cuda_device_count", &cuda_device_count, "CUDA devices visible now (0 without CUDA).");
}

}  // namespace kvattn::python

NB_MODULE(_kvattn, m) {
  m.doc() = "kvattn: paged-KV attention for LLM serving engines (C++ core).";
  kvattn::python::bind_basics(m);
  kvattn::python::bind_pools(m);
  kvattn::python::bind_backend(m);
}
