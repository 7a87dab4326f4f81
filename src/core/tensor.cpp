#include "kvattn/tensor.h"

#include <sstream>

#include "kvattn/error.h"

namespace kvattn {

std::string Device::str() const {
  return type == DeviceType::kCPU ? std::string("cpu") : "cuda:" + std::to_string(index);
}

TensorView::TensorView(void* data, DType dtype, Device device, std::initializer_list<int64_t> shape)
    : data_(data), dtype_(dtype), device_(device), ndim_(int(shape.size())) {
  check_arg(shape.size() <= size_t(kMaxDims), "shape", "got ", shape.size(),
            " dimensions, expected at most ", kMaxDims);
  int i = 0;
  for (int64_t s : shape) {
    check_arg(s >= 0, "shape", "dimension ", i, " is ", s, ", expected >= 0");
    shape_[i++] = s;
  }
  int64_t stride = 1;
  for (int d = ndim_ - 1; d >= 0; --d) {
    strides_[d] = stride;
    stride *= shape_[d];
  }
}

TensorView::TensorView(void* data, DType dtype, Device device, int ndim, const int64_t* shape,
                       const int64_t* strides)
    : data_(data), dtype_(dtype), device_(device), ndim_(ndim) {
  check_arg(ndim >= 0 && ndim <= kMaxDims, "ndim", "got ", ndim, ", expected 0..", kMaxDims);
  for (int d = 0; d < ndim; ++d) {
    check_arg(shape[d] >= 0, "shape", "dimension ", d, " is ", shape[d], ", expected >= 0");
    shape_[d] = shape[d];
    strides_[d] = strides[d];
  }
}

int64_t TensorView::size(int dim) const {
  const int d = dim < 0 ? dim + ndim_ : dim;
  check_arg(d >= 0 && d < ndim_, "dim", "got ", dim, " for a ", ndim_, "-d tensor");
  return shape_[d];
}

int64_t TensorView::stride(int dim) const {
  const int d = dim < 0 ? dim + ndim_ : dim;
  check_arg(d >= 0 && d < ndim_, "dim", "got ", dim, " for a ", ndim_, "-d tensor");
  return strides_[d];
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim_; ++d) n *= shape_[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int d = ndim_ - 1; d >= 0; --d) {
    if (shape_[d] != 1 && strides_[d] != expected) return false;
    expected *= shape_[d];
  }
  return true;
}

std::string TensorView::describe() const {
  std::ostringstream os;
  os << "[";
  for (int d = 0; d < ndim_; ++d) os << (d ? ", " : "") << shape_[d];
  os << "] " << dtype_name(dtype_) << " " << device_.str();
  return os.str();
}

TensorView TensorView::slice0(int64_t begin, int64_t end) const {
  check_arg(ndim_ >= 1, "tensor", "slice0 of a 0-d tensor");
  check_arg(0 <= begin && begin <= end && end <= shape_[0], "slice", "[", begin, ", ", end,
            ") outside [0, ", shape_[0], "]");
  TensorView out = *this;
  out.shape_[0] = end - begin;
  out.data_ = static_cast<char*>(data_) + begin * strides_[0] * dtype_size(dtype_);
  return out;
}

TensorView TensorView::reshape(std::initializer_list<int64_t> shape) const {
  check_arg(is_contiguous(), "tensor", describe(), " is not contiguous; reshape needs it");
  TensorView out(data_, dtype_, device_, shape);
  check_arg(out.numel() == numel(), "shape", "reshape of ", describe(), " to ", out.numel(),
            " elements");
  return out;
}

int64_t read_index(const TensorView& t, int64_t i) {
  if (t.dtype() == DType::kInt32) return t.data_as<const int32_t>()[i * t.stride(0)];
  if (t.dtype() == DType::kInt64) return t.data_as<const int64_t>()[i * t.stride(0)];
  throw_error(ErrorKind::kInvalidArgument, "index tensor", "dtype ", dtype_name(t.dtype()),
              ", expected int32 or int64");
}

std::ostream& operator<<(std::ostream& os, const Device& device) {
  return os << device.str();
}

std::ostream& operator<<(std::ostream& os, const TensorView& tensor) {
  return os << tensor.describe();
}

}  // namespace kvattn
