// DLPack <-> TensorView: the one place where a Python array becomes a kvattn view and back.
// Nothing here copies tensor data: a view points into the producer's memory, an exported array
// points into kvattn's (and keeps its owner alive).
#include <nanobind/stl/vector.h>

#include <new>
#include <stdexcept>
#include <string>

#include "bindings.h"

namespace kvattn::python {

namespace {

std::string dlpack_dtype_name(nb::dlpack::dtype dt) {
  const char* prefix = "code";
  switch (dt.code) {
    case kDlInt:
      prefix = "int";
      break;
    case kDlUInt:
      prefix = "uint";
      break;
    case kDlFloat:
      prefix = "float";
      break;
    case kDlBfloat:
      prefix = "bfloat";
      break;
    case kDlBool:
      prefix = "bool";
      break;
    case kDlFloat8E4M3FN:
      return "float8_e4m3fn";
    case kDlFloat8E5M2:
      return "float8_e5m2";
    default:
      return "dlpack code " + std::to_string(dt.code) + " bits " + std::to_string(dt.bits);
  }
  return std::string(prefix) + std::to_string(dt.bits);
}

/// The storage dtypes that an unsigned-integer array of the same width may carry as raw bits.
bool carried_as_bits(DType storage) {
  return storage == DType::kBFloat16 || storage == DType::kFloat16 || is_fp8_dtype(storage);
}

DType dtype_from_dlpack(nb::dlpack::dtype dt, std::optional<DType> storage, const char* name) {
  check_arg(dt.lanes == 1, name, "has ", dt.lanes, " lanes per element, expected 1");
  if (storage && carried_as_bits(*storage) && dt.code == kDlUInt &&
      dt.bits == 8 * dtype_size(*storage)) {
    return *storage;
  }
  switch (dt.code) {
    case kDlFloat:
      if (dt.bits == 32) return DType::kFloat32;
      if (dt.bits == 16) return DType::kFloat16;
      break;
    case kDlBfloat:
      if (dt.bits == 16) return DType::kBFloat16;
      break;
    case kDlFloat8E4M3FN:
      if (dt.bits == 8) return DType::kFloat8E4M3;
      break;
    case kDlFloat8E5M2:
      if (dt.bits == 8) return DType::kFloat8E5M2;
      break;
    case kDlInt:
      if (dt.bits == 32) return DType::kInt32;
      if (dt.bits == 64) return DType::kInt64;
      break;
    case kDlUInt:
    case kDlBool:
      if (dt.bits == 8) return DType::kUInt8;
      break;
    default:
      break;
  }
  throw_error(ErrorKind::kInvalidArgument, name, "dtype ", dlpack_dtype_name(dt),
              " is not supported (expected float32, float16, bfloat16, float8_e4m3fn, "
              "float8_e5m2, int32, int64, uint8 or bool",
              storage ? std::string(", or uint") + std::to_string(8 * dtype_size(*storage)) +
                            " bits of " + dtype_name(*storage)
                      : std::string(),
              ")");
}

Device device_from_dlpack(int device_type, int device_id, const char* name) {
  switch (device_type) {
    case kDlCpu:
    case kDlCudaHost:
      return Device::cpu();
    case kDlCuda:
    case kDlCudaManaged:
      return Device::cuda(device_id);
    default:
      throw_error(ErrorKind::kInvalidArgument, name, "DLPack device type ", device_type,
                  " is not supported (expected CPU, CUDA, CUDA host or CUDA managed memory)");
  }
}

nb::dlpack::dtype dlpack_dtype_of(DType dtype, bool as_bits) {
  const uint8_t bits = uint8_t(8 * dtype_size(dtype));
  if (as_bits && carried_as_bits(dtype)) return {kDlUInt, bits, 1};
  switch (dtype) {
    case DType::kFloat32:
    case DType::kFloat16:
      return {kDlFloat, bits, 1};
    case DType::kBFloat16:
      return {kDlBfloat, bits, 1};
    case DType::kFloat8E4M3:
      return {kDlFloat8E4M3FN, bits, 1};
    case DType::kFloat8E5M2:
      return {kDlFloat8E5M2, bits, 1};
    case DType::kInt32:
    case DType::kInt64:
      return {kDlInt, bits, 1};
    case DType::kUInt8:
      return {kDlUInt, bits, 1};
  }
  return {kDlUInt, bits, 1};
}

/// The one place where DLPack fields become a TensorView (the data pointer already includes any
/// byte offset). Null strides (allowed before DLPack 1.2) mean row-major.
TensorView make_view(void* data, nb::dlpack::dtype raw_dtype, int device_type, int device_id,
                     int ndim, const int64_t* shape, const int64_t* strides, const char* name,
                     std::optional<DType> storage) {
  const DType dtype = dtype_from_dlpack(raw_dtype, storage, name);
  const Device device = device_from_dlpack(device_type, device_id, name);
  check_arg(ndim >= 0 && ndim <= TensorView::kMaxDims, name, "has ", ndim,
            " dimensions, expected at most ", TensorView::kMaxDims);
  int64_t row_major[TensorView::kMaxDims];
  if (strides == nullptr) {
    int64_t stride = 1;
    for (int d = ndim - 1; d >= 0; --d) {
      row_major[d] = stride;
      stride *= shape[d];
    }
    strides = row_major;
  }
  return TensorView(data, dtype, device, ndim, shape, strides);
}

// ---- DLPack's C exchange API (DLPack 1.3, dlpack.h "DLPackExchangeAPI"), declared here from the
// specification: nanobind 3.1 does not use it. Layouts are the C ABI of that header.

struct DlpackVersion {
  uint32_t major;
  uint32_t minor;
};

struct DlpackManagedTensorVersioned {
  DlpackVersion version;
  void* manager_ctx;
  void (*deleter)(DlpackManagedTensorVersioned* self);
  uint64_t flags;
  nb::dlpack::dltensor dl_tensor;  // nanobind's DLTensor has the ABI layout
};

struct DlpackExchangeApiHeader {
  DlpackVersion version;
  DlpackExchangeApiHeader* prev_api;
};

}  // namespace

struct DlpackExchangeApi {
  DlpackExchangeApiHeader header;
  int (*managed_tensor_allocator)(nb::dlpack::dltensor* prototype,
                                  DlpackManagedTensorVersioned** out, void* error_ctx,
                                  void (*set_error)(void* error_ctx, const char* kind,
                                                    const char* message));
  int (*managed_tensor_from_py_object_no_sync)(void* py_object, DlpackManagedTensorVersioned** out);
  int (*managed_tensor_to_py_object_no_sync)(DlpackManagedTensorVersioned* tensor,
                                             void** out_py_object);
  int (*dltensor_from_py_object_no_sync)(void* py_object, nb::dlpack::dltensor* out);
  int (*current_work_stream)(int32_t device_type, int32_t device_id, void** out_stream);
};

namespace {

/// The exchange API of a type: its __dlpack_c_exchange_api__ capsule, walked back along prev_api
/// to the major version 1 table this file knows. nullptr where there is none.
const DlpackExchangeApi* lookup_exchange_api(PyTypeObject* type) {
  PyObject* capsule =
      PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), "__dlpack_c_exchange_api__");
  if (capsule == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  const DlpackExchangeApiHeader* header = nullptr;
  if (PyCapsule_IsValid(capsule, "dlpack_exchange_api")) {
    header = static_cast<const DlpackExchangeApiHeader*>(
        PyCapsule_GetPointer(capsule, "dlpack_exchange_api"));
  }
  Py_DECREF(capsule);  // the type keeps its capsule (and the static table behind it)
  while (header != nullptr && header->version.major != 1) header = header->prev_api;
  return reinterpret_cast<const DlpackExchangeApi*>(header);
}

/// Per-type cache of lookup_exchange_api (types without the API are cached too, as nullptr).
/// The few array types a process passes fit; past kMaxTypes a type is looked up every call.
/// Cached types are kept alive, so a pointer can never be reused by another type.
const DlpackExchangeApi* exchange_api_of(PyObject* object) {
  constexpr int kMaxTypes = 16;
  static PyTypeObject* types[kMaxTypes];
  static const DlpackExchangeApi* apis[kMaxTypes];
  static int count = 0;
  PyTypeObject* type = Py_TYPE(object);
  for (int i = 0; i < count; ++i) {
    if (types[i] == type) return apis[i];
  }
  const DlpackExchangeApi* api = lookup_exchange_api(type);
  if (count < kMaxTypes) {
    Py_INCREF(type);
    types[count] = type;
    apis[count] = api;
    ++count;
  }
  return api;
}

struct AllocationError {
  std::string kind;
  std::string message;
};

void set_allocation_error(void* context, const char* kind, const char* message) {
  auto* error = static_cast<AllocationError*>(context);
  error->kind = kind ? kind : "";
  error->message = message ? message : "";
}

/// The producer's allocation of a [rows, width] array like `like` (dtype, device), or a raised
/// Python exception.
DlpackManagedTensorVersioned* allocate(const ArrayArg& like, const nb::dlpack::dltensor& shape_of,
                                       const char* name) {
  nb::dlpack::dltensor prototype = shape_of;
  AllocationError error;
  DlpackManagedTensorVersioned* managed = nullptr;
  if (like.api->managed_tensor_allocator(&prototype, &managed, &error, set_allocation_error) != 0 ||
      managed == nullptr) {
    // (the C++ timing loop allocates with the GIL released: no Python error state there)
    if (PyGILState_Check() && PyErr_Occurred()) throw nb::python_error();
    const std::string message = std::string("kvattn: ") + name +
                                ": the array library could not allocate it: " +
                                (error.kind.empty() ? "" : error.kind + ": ") + error.message;
    if (error.kind == "MemoryError") throw std::bad_alloc();
    throw std::runtime_error(message);
  }
  return managed;
}

nb::dlpack::dltensor prototype_like(const ArrayArg& like, int64_t* shape) {
  nb::dlpack::dltensor prototype;
  prototype.ndim = 2;
  prototype.dtype = like.raw_dtype;
  prototype.device = {like.view.device().is_cuda() ? int32_t(kDlCuda) : int32_t(kDlCpu),
                      like.view.device().is_cuda() ? int32_t(like.view.device().index) : 0};
  prototype.shape = shape;
  return prototype;
}

TensorView managed_view(const DlpackManagedTensorVersioned* managed, const char* name,
                        std::optional<DType> storage) {
  const nb::dlpack::dltensor& t = managed->dl_tensor;
  return make_view(static_cast<uint8_t*>(t.data) + t.byte_offset, t.dtype, t.device.device_type,
                   t.device.device_id, t.ndim, t.shape, t.strides, name, storage);
}

}  // namespace

TensorView to_view(const Array& array, const char* name, std::optional<DType> storage) {
  check_arg(array.is_valid(), name, "is None, expected an array");
  return make_view(array.data(), array.dtype(), array.device_type(), array.device_id(),
                   int(array.ndim()), array.shape_ptr(), array.stride_ptr(), name, storage);
}

ArrayArg array_arg(nb::handle object, const char* name, std::optional<DType> storage,
                   bool optional) {
  ArrayArg arg;
  if (object.is_none()) {
    check_arg(optional, name, "is None, expected an array");
    return arg;
  }
  arg.api = exchange_api_of(object.ptr());
  if (arg.api != nullptr && arg.api->dltensor_from_py_object_no_sync != nullptr) {
    nb::dlpack::dltensor t;
    if (arg.api->dltensor_from_py_object_no_sync(object.ptr(), &t) != 0) {
      throw nb::python_error();
    }
    arg.raw_dtype = t.dtype;
    arg.view =
        make_view(static_cast<uint8_t*>(t.data) + t.byte_offset, t.dtype, t.device.device_type,
                  t.device.device_id, t.ndim, t.shape, t.strides, name, storage);
    return arg;
  }
  if (!nb::try_cast(object, arg.imported)) {
    throw nb::type_error((std::string("kvattn: ") + name +
                          ": expected an array (torch, NumPy or any __dlpack__ object), got " +
                          nb::str(nb::handle(Py_TYPE(object.ptr()))).c_str())
                             .c_str());
  }
  arg.raw_dtype = arg.imported.dtype();
  arg.view = to_view(arg.imported, name, storage);
  return arg;
}

nb::object new_array_like(nb::handle like, const ArrayArg& like_arg, int64_t rows, int64_t width,
                          const char* name, std::optional<DType> storage, ArrayArg& out,
                          bool dlpack_alloc) {
  const DlpackExchangeApi* api = like_arg.api;
  const bool can_exchange = api != nullptr && api->managed_tensor_allocator != nullptr &&
                            api->managed_tensor_to_py_object_no_sync != nullptr;
  if (!(dlpack_alloc && can_exchange)) {
    static PyObject* new_empty_name = PyUnicode_InternFromString("new_empty");
    if (PyObject* method = PyObject_GetAttr(like.ptr(), new_empty_name)) {
      nb::object result = nb::steal(method)(nb::make_tuple(rows, width));
      out = array_arg(result, name, storage);
      return result;
    }
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw nb::python_error();
    PyErr_Clear();
  }
  if (can_exchange) {
    int64_t shape[2] = {rows, width};
    DlpackManagedTensorVersioned* managed =
        allocate(like_arg, prototype_like(like_arg, shape), name);
    try {
      out.view = managed_view(managed, name, storage);
    } catch (...) {
      if (managed->deleter) managed->deleter(managed);
      throw;
    }
    out.raw_dtype = managed->dl_tensor.dtype;
    out.api = api;
    void* object = nullptr;
    // Takes ownership of `managed`; the new tensor keeps the memory the view points into.
    if (api->managed_tensor_to_py_object_no_sync(managed, &object) != 0 || object == nullptr) {
      throw nb::python_error();
    }
    return nb::steal(static_cast<PyObject*>(object));
  }
  throw nb::type_error((std::string("kvattn: ") + name + ": cannot allocate an output like " +
                        nb::str(nb::handle(Py_TYPE(like.ptr()))).c_str() + "; pass out=")
                           .c_str());
}

bool has_exchange_api(nb::handle object) {
  const DlpackExchangeApi* api = exchange_api_of(object.ptr());
  return api != nullptr && api->dltensor_from_py_object_no_sync != nullptr &&
         api->managed_tensor_allocator != nullptr &&
         api->managed_tensor_to_py_object_no_sync != nullptr;
}

void* allocate_managed_like(const ArrayArg& like_arg, int64_t rows, int64_t width, const char* name,
                            std::optional<DType> storage, TensorView& view) {
  check_arg(like_arg.api != nullptr && like_arg.api->managed_tensor_allocator != nullptr, name,
            "its array type has no DLPack C exchange API to allocate through");
  int64_t shape[2] = {rows, width};
  DlpackManagedTensorVersioned* managed = allocate(like_arg, prototype_like(like_arg, shape), name);
  try {
    view = managed_view(managed, name, storage);
  } catch (...) {
    free_managed(managed);
    throw;
  }
  return managed;
}

void free_managed(void* managed) {
  auto* m = static_cast<DlpackManagedTensorVersioned*>(managed);
  if (m != nullptr && m->deleter != nullptr) m->deleter(m);
}

TensorView to_view_or_absent(const Array& array, const char* name, std::optional<DType> storage) {
  return array.is_valid() ? to_view(array, name, storage) : TensorView();
}

nb::object view_to_array(const TensorView& view, nb::handle owner, bool as_bits) {
  if (!view.defined()) return nb::none();
  size_t shape[TensorView::kMaxDims];
  int64_t strides[TensorView::kMaxDims];
  for (int d = 0; d < view.ndim(); ++d) {
    shape[d] = size_t(view.size(d));
    strides[d] = view.stride(d);
  }
  const int device_type = view.device().is_cuda() ? kDlCuda : kDlCpu;
  // array_api: an object with __dlpack__ and __dlpack_device__ (NumPy, torch and others
  // import it with from_dlpack; a bare capsule would only suit legacy importers).
  nb::ndarray<nb::array_api> array(view.data(), size_t(view.ndim()), shape, owner, strides,
                                   dlpack_dtype_of(view.dtype(), as_bits), device_type,
                                   view.device().index);
  return nb::cast(array, nb::rv_policy::reference);
}

/// Slot or page ids from a NumPy array, a list or any sequence of ints.
std::vector<int32_t> int32_values(nb::handle values, const char* name) {
  try {
    return nb::cast<std::vector<int32_t>>(values);
  } catch (const nb::cast_error&) {
    throw_error(ErrorKind::kInvalidArgument, name, "expected a sequence of int32 values, got ",
                nb::str(nb::handle(Py_TYPE(values.ptr()))).c_str());
  }
}

nb::object int32_numpy(std::vector<int32_t> values) {
  auto* heap = new std::vector<int32_t>(std::move(values));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<int32_t>*>(p); });
  const size_t shape[1] = {heap->size()};
  return nb::cast(nb::ndarray<nb::numpy, int32_t, nb::ndim<1>>(heap->data(), 1, shape, owner),
                  nb::rv_policy::reference);
}

}  // namespace kvattn::python
