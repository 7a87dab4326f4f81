// DLPack <-> TensorView: the one place where a Python array becomes a kvattn view and back.
// Nothing here copies tensor data: a view points into the producer's memory, an exported array
// points into kvattn's (and keeps its owner alive).
#include <nanobind/stl/vector.h>

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

}  // namespace

TensorView to_view(const Array& array, const char* name, std::optional<DType> storage) {
  check_arg(array.is_valid(), name, "is None, expected an array");
  const DType dtype = dtype_from_dlpack(array.dtype(), storage, name);
  const Device device = device_from_dlpack(array.device_type(), array.device_id(), name);
  const int ndim = int(array.ndim());
  check_arg(ndim <= TensorView::kMaxDims, name, "has ", ndim, " dimensions, expected at most ",
            TensorView::kMaxDims);
  return TensorView(array.data(), dtype, device, ndim, array.shape_ptr(), array.stride_ptr());
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
